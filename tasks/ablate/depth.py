"""The depth probe: Xiong et al.'s Theorem 1 checked directly, without training. Per block layout,
depth and seed, the gradient norm of each block's weight matrices after one backward pass at
initialisation (standard parametrization, model/probes.py: gradient_norms_at_init), at the arm
scale of the study. Post-LN's last-layer gradient is predicted to exceed Pre-LN's by a factor
that grows like √L.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from model.probes import gradient_norms_at_init
from tasks.config import Config


def depth_probe(cfg: Config) -> dict[str, Any]:
    """``last_layer``: block -> depth -> seed -> the last block's gradient norm; ``per_layer``:
    block -> depth -> each block's norm, mean over seeds (JSON keys are strings)."""
    a = cfg.ablation
    model = dataclasses.replace(cfg.model, d_model=a.d_model, n_head=a.n_head, seq_len=a.seq_len)
    last: dict[str, dict[str, dict[str, float]]] = {}
    per_layer: dict[str, dict[str, list[float]]] = {}
    for block in a.blocks:
        for depth in a.probe_depths:
            norms = {
                seed: gradient_norms_at_init(model, depth, block, (seed,), a.batch_size, cfg.tokenizer.vocab_size)
                for seed in a.seeds
            }
            last.setdefault(block, {})[str(depth)] = {str(s): n[f"block{depth - 1}"] for s, n in norms.items()}
            per_layer.setdefault(block, {})[str(depth)] = [
                float(np.mean([n[f"block{i}"] for n in norms.values()])) for i in range(depth)
            ]
    return {"depths": list(a.probe_depths), "seeds": list(a.seeds), "last_layer": last, "per_layer": per_layer}
