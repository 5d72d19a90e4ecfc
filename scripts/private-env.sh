# Sourced by make's shell (scripts/private-shell) and scripts/setup.sh: what every `spikelab`
# command does first (flows/__main__.py), for the commands they run (pip, dvc, the stages).
#   umask  nothing they create is writable by the group or others, whatever the shell's umask
#   env    TMPDIR and every engine's cache and lock folder under <state>/scratch, 0700, and every
#          engine's telemetry off (tasks/runtime/private_env.py)
umask g-w,o-w
spikelab_env=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && "${PYTHON:-python3}" -m tasks.runtime.private_env) || exit 2
eval "$spikelab_env"
unset spikelab_env
