# Sourced by make's shell (scripts/private-shell) and scripts/setup.sh: what every `spikelab`
# command does first (flows/__main__.py), for the commands they run (pip, dvc, the stages).
#   umask  nothing they create is writable by the group or others, whatever the shell's umask
#   env    TMPDIR and every engine's cache and lock folder under <state>/scratch, 0700, and every
#          engine's telemetry off (tasks/runtime/private_env.py)
#   pyenv  the Python version never read from a folder others may add files to (PYENV_VERSION)
umask g-w,o-w
# pyenv's python3 shim (the Python that runs below, and makes setup's .venv) takes its version from
# a .python-version in the folder it runs in or ANY folder above it: one planted in /tmp by another
# user would choose the interpreter. Unless PYENV_VERSION names one, it is read here as pyenv reads
# it, from the checkout up, but never from a folder others may add files to (from there on: pyenv's
# global version). pyenv itself refuses a version naming a path outside its versions.
spikelab_pyenv=$(command -v pyenv || echo "${PYENV_ROOT:-${HOME:-}/.pyenv}/libexec/pyenv")
if [ -z "${PYENV_VERSION:-}" ] && [ -x "$spikelab_pyenv" ]; then
  spikelab_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
  spikelab_file=$("$spikelab_pyenv" root)/version
  while read -r spikelab_uid spikelab_mode < <(stat -c '%u %a' "$spikelab_dir"); do
    if { [ "$spikelab_uid" != 0 ] && [ "$spikelab_uid" != "$(id -u)" ]; } || ((8#$spikelab_mode & 8#022)); then
      break
    elif [ -f "$spikelab_dir/.python-version" ]; then
      spikelab_file=$spikelab_dir/.python-version
      break
    elif [ "$spikelab_dir" = / ]; then
      break
    fi
    spikelab_dir=$(dirname "$spikelab_dir")
  done
  PYENV_VERSION=$("$spikelab_pyenv" version-file-read "$spikelab_file" 2>/dev/null) || PYENV_VERSION=system
  export PYENV_VERSION
  unset spikelab_dir spikelab_file spikelab_uid spikelab_mode
fi
unset spikelab_pyenv
spikelab_env=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && "${PYTHON:-python3}" -m tasks.runtime.private_env) || exit 2
eval "$spikelab_env"
unset spikelab_env
