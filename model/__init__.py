"""Pure PyTorch: the model, the training step and loop, callbacks, checkpoints (see DESIGN)."""

import os

# MKL's strict conditional-numerical-reproducibility mode: fp32 matrix products give the same bits
# whatever the thread count (on an AVX-512 CPU, 1 and 2 threads gave different weights without it;
# tests/test_threads.py). MKL reads it on its first call, so it is set before any training runs.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
