#!/usr/bin/env bash
# Create .venv and install spikelab with the pinned dependency set. Idempotent: a rerun checks and
# takes seconds. Says what each step installs and about how long it takes, then how long it took;
# pip's and apt's errors stay on the terminal (their progress chatter does not).
#   TORCH_SPEC  what to install for torch (default torch==2.13.0: this machine's CPU wheel).
#               On a GPU machine install a CUDA build of torch 2.13 into .venv first, then
#               run with TORCH_SPEC=skip.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
source scripts/private-env.sh  # the CLI's umask; pip's temporary files under .spikelab/, not /tmp
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
started=$SECONDS
step_started=$SECONDS
say() { echo "setup: $*"; }
step() { say "$*"; step_started=$SECONDS; }
took() { say "  done in $((SECONDS - step_started)) s"; }
# -qq: errors only (a machine's pip config may add index folders it lacks, a warning per package)
pip() { .venv/bin/python -m pip --disable-pip-version-check -qq "$@"; }
installed() { .venv/bin/python -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$1" 2>/dev/null; }

if [ ! -x .venv/bin/python ]; then
  say "first run: 3-8 min on a 2-core machine, by how fast packages download (torch 0.5-3 min,"
  say "  the rest 2.5-4 min, Chromium and PostgreSQL via apt ~1-2 min where missing); a rerun takes"
  say "  seconds. Then: make demo (about 5 min)."
  step "creating .venv with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv .venv
  took
fi
if [ "$TORCH_SPEC" = skip ]; then
  say "torch: skipped (TORCH_SPEC=skip: the one already in .venv is used)"
elif installed torch; then
  step "torch: checking $TORCH_SPEC (installed)"
  pip install "$TORCH_SPEC"
  took
else
  step "installing $TORCH_SPEC (the CPU build: ~200 MB to download, ~900 MB on disk): 0.5-3 min"
  pip install "$TORCH_SPEC"
  took
fi
if installed spikelab; then
  step "spikelab and its pinned dependencies: checking (installed)"
else
  step "installing spikelab and its pinned dependencies (Prefect, MLflow, DVC, Optuna, Dask, matplotlib,"
  say "  pytest, ruff, mypy, psycopg, ...: ~280 packages pinned in constraints.txt): 2.5-4 min"
fi
pip install -c constraints.txt -e ".[dev,cluster]"
took
# Debian packages the tests drive: Chromium and its driver (the browser tests), PostgreSQL (the
# `scaleout` tests' database). Installed where apt-get is there and we are root; anywhere else (or
# if apt fails) those tests skip, saying why. apt's output goes to a log under .spikelab/, shown
# when it fails.
apt_install() {  # $1: what they are for; $2: a command the packages provide; the rest: the packages
  local log="$TMPDIR/setup-apt.log"
  command -v "$2" >/dev/null || ls /usr/lib/postgresql/*/bin/"$2" >/dev/null 2>&1 && return 0
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    step "installing ${*:3} via apt for $1: 1-2 min"
    if { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${@:3}"; } >"$log" 2>&1; then
      took
      return 0
    fi
    say "apt-get failed; its last lines ($log):" >&2
    tail -n 15 "$log" >&2
  fi
  say "${*:3} not installed; $1 will be skipped, saying why" >&2
}
# DVC typed in a shell (dvc exp run, dvc pull) keeps its site cache there too, not in /var/tmp/dvc
.venv/bin/dvc config --local core.site_cache_dir "$DVC_SITE_CACHE_DIR"
apt_install "the browser tests" chromedriver chromium chromium-driver
apt_install "the scaleout tests' database" initdb postgresql
.venv/bin/python -c "import sys, torch, prefect, mlflow, optuna, dvc, yaml; print(f'setup: spikelab ready in {sys.argv[1]} s: torch', torch.__version__, '| prefect', prefect.__version__, '| mlflow', mlflow.__version__, '| optuna', optuna.__version__)" "$((SECONDS - started))"
