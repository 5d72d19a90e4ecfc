#!/usr/bin/env bash
# Create .venv and install spikelab with the pinned dependency set. Idempotent: a rerun checks and
# takes seconds. Says how long the first run takes (SETUP_TIME: the one figure README.md states too),
# what each step installs and how long it took;
# pip's and apt's errors stay on the terminal (their progress chatter does not).
#   TORCH_SPEC  what to install for torch (default torch==2.13.0: this machine's CPU wheel).
#               On a GPU machine install a CUDA build of torch 2.13 into .venv first, then
#               run with TORCH_SPEC=skip.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
started=$SECONDS
step_started=$SECONDS
say() { echo "setup: $*"; }
step() { say "$*"; step_started=$SECONDS; }
took() { say "  done in $((SECONDS - step_started)) s"; }
# The folder $1 (its physical path) and each folder above it, nearest first: "uid mode folder".
folders_up() {
  local dir
  dir=$(cd "$1" && pwd -P)
  while :; do
    echo "$(stat -c '%u %a' "$dir") $dir"
    [ "$dir" = / ] && return 0
    dir=$(dirname "$dir")
  done
}
others() {  # $1 add|rename, $2 uid, $3 mode (octal): may users other than us and root do that there?
  [ "$2" != 0 ] && [ "$2" != "$(id -u)" ] && return 0
  (($3 & 8#022)) || return 1
  [ "$1" = add ] || ! (($3 & 8#1000))  # the sticky bit keeps them from renaming what is ours
}
# A checkout in a folder another user may rename things in could be swapped for theirs while pip
# installs it; refused before anything is made (the state directory's check, model/private.py:
# state_dir, covers the checkout only while SPIKELAB_STATE is left at its default).
while read -r uid mode folder; do
  if others rename "$uid" "8#$mode"; then
    printf "setup: error: checkout %s: %s is another user's or writable by others (uid %s, mode %04d), who could swap it; move the checkout\n" "$PWD" "$folder" "$uid" "$mode" >&2
    exit 2
  fi
done < <(folders_up .)
source scripts/private-env.sh  # the CLI's umask; pip's temporary files under .spikelab/, not /tmp
# pip's user agent runs `rustc --version` (and a package built from source may run cargo) through
# rustup's proxy, which obeys a rust-toolchain(.toml) in ANY folder above the working directory: one
# planted in /tmp (`path = "<a folder of theirs>"`) ran another user's bin/rustc as us. RUSTUP_TOOLCHAIN
# outranks every toolchain file, so setup pins rustup's default toolchain (asked from /, where no
# toolchain file applies; none configured: a name that fails), and RUSTUP_AUTO_INSTALL=0 keeps a
# pinned name from downloading. Chosen over keeping rustup off pip's PATH, which would break a
# dependency that has to be built from Rust source; pinned, it builds with the user's default toolchain.
if [ -z "${RUSTUP_TOOLCHAIN:-}" ] && command -v rustup >/dev/null; then
  RUSTUP_TOOLCHAIN=$(cd / && rustup default 2>/dev/null | awk 'NR == 1 { print $1 }') || true
  export RUSTUP_TOOLCHAIN=${RUSTUP_TOOLCHAIN:-none}
fi
export RUSTUP_AUTO_INSTALL=0
# Cargo reads .cargo/config.toml in every folder above where it runs (pip builds in $TMPDIR), and no
# setting stops that walk; its settings can name programs to run (build.rustc-wrapper). Where a folder
# above the checkout or its scratch lets other users add files (/tmp, sticky or not), setup's cargo
# refuses, saying why; elsewhere a Rust build runs as usual.
open_folder=
while read -r uid mode folder; do
  if others add "$uid" "8#$mode"; then open_folder=$folder && break; fi
done < <(folders_up .; folders_up "$TMPDIR")
if [ -n "$open_folder" ]; then
  refusing_bin=$TMPDIR/setup-bin  # private: $TMPDIR is <state>/scratch/tmp, 0700
  mkdir -p "$refusing_bin"
  printf '#!/bin/sh\necho "$SPIKELAB_CARGO_REFUSED" >&2\nexit 1\n' >"$refusing_bin/cargo"
  chmod 700 "$refusing_bin/cargo"
  export SPIKELAB_CARGO_REFUSED="setup: cargo refused: other users may add files to $open_folder, and cargo would read their $open_folder/.cargo/config.toml; to build from Rust source, move the checkout (and SPIKELAB_STATE) out of it"
  export PATH="$refusing_bin:$PATH" CARGO=$refusing_bin/cargo
fi
unset uid mode folder open_folder refusing_bin
# -qq: errors only (a machine's pip config may add index folders it lacks, a warning per package)
pip() { .venv/bin/python -m pip --disable-pip-version-check -qq "$@"; }
installed() { .venv/bin/python -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$1" 2>/dev/null; }
# Sourced (tests/test_setup_safety.py): the environment and pip() above, nothing installed.
[ "${BASH_SOURCE[0]}" = "$0" ] || return 0

SETUP_TIME="about 3 min on 2 cores (2.8 measured from a fresh clone, pip's downloads cached)"
if [ ! -x .venv/bin/python ]; then
  say "first run: $SETUP_TIME; a rerun takes seconds"
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
  step "installing $TORCH_SPEC (the CPU build: ~200 MB to download, ~900 MB on disk)"
  pip install "$TORCH_SPEC"
  took
fi
if installed spikelab; then
  step "spikelab and its pinned dependencies: checking (installed)"
else
  step "installing spikelab and its pinned dependencies (Prefect, MLflow, DVC, Optuna, Dask, matplotlib,"
  say "  pytest, ruff, mypy, psycopg, ...: ~280 packages pinned in constraints.txt)"
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
    step "installing ${*:3} via apt for $1"
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
# The next step, said only where it is one: run by hand (under make, `make setup` says it and
# `make demo`, `make repro`, `make test` go on to their own).
[ -n "${MAKELEVEL:-}" ] || say "next: make demo (every stage at tiny sizes in a copy, and one claim decided at demo size: about 3 min after setup on 2 cores)"
