"""Pure PyTorch: the model, the training step and loop, callbacks, checkpoints (see DESIGN)."""

import os

from model.numerics import MODES, process_mode

# The libraries' settings of this process's numerics mode (model/numerics.py), read when torch
# loads; a launcher that read the config has set them already, and a setting given by hand wins.
# Native keeps MKL strict: on an AVX-512 CPU, 1 and 2 threads gave different weights without it
# (tests/test_threads.py); portable's COMPATIBLE branch is the one that held across CPU vendors.
for _key, _value in MODES[process_mode()].items():
    os.environ.setdefault(_key, _value)
