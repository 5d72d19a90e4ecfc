#!/usr/bin/env bash
# Create .venv and install spikelab with the pinned dependency set. Idempotent.
#   TORCH_SPEC  what to install for torch (default torch==2.13.0: this machine's CPU wheel).
#               On a GPU machine install a CUDA build of torch 2.13 into .venv first, then
#               run with TORCH_SPEC=skip.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
source scripts/private-env.sh  # the CLI's umask; pip's temporary files under .spikelab/, not /tmp
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# -qq: errors only (a machine's pip config may add index folders it lacks, a warning per package)
pip() { .venv/bin/python -m pip --disable-pip-version-check -qq "$@"; }
if [ "${TORCH_SPEC:-torch==2.13.0}" != skip ]; then pip install "${TORCH_SPEC:-torch==2.13.0}"; fi
pip install -c constraints.txt -e ".[dev,cluster]"
# Debian packages the tests drive: Chromium and its driver (the browser tests), PostgreSQL (the
# `scaleout` tests' database). Installed where apt-get is there and we are root; anywhere else (or
# if apt fails) those tests skip, saying why.
apt_install() {  # $1: a command the package provides; the rest: the packages
  command -v "$1" >/dev/null || ls /usr/lib/postgresql/*/bin/"$1" >/dev/null 2>&1 && return 0
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${@:2}"; } >/dev/null 2>&1 && return 0
  fi
  echo "setup: ${*:2} not installed; the tests that need $1 will be skipped" >&2
}
# DVC typed in a shell (dvc exp run, dvc pull) keeps its site cache there too, not in /var/tmp/dvc
.venv/bin/dvc config --local core.site_cache_dir "$DVC_SITE_CACHE_DIR"
apt_install chromedriver chromium chromium-driver
apt_install initdb postgresql
.venv/bin/python -c "import torch, prefect, mlflow, optuna, dvc, yaml; print('spikelab ready: torch', torch.__version__, '| prefect', prefect.__version__, '| mlflow', mlflow.__version__, '| optuna', optuna.__version__)"
