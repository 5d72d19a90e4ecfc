"""The depth probe: Xiong et al.'s Theorem 1 checked directly, without training. Per block layout,
depth and seed, the gradient norm of each block's weight matrices after one backward pass at
initialisation (model/probes.py: gradient_norms_at_init), at the arm scale of the study, under the
paper's init (the xiong family's model keys, tasks/design/preregistration.yaml) and, for comparison, this project's GPT-2 init.
Post-LN's last-layer gradient is predicted to exceed Pre-LN's by a factor that grows like √L.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from model.config import Init, ModelConfig
from model.probes import gradient_norms_at_init
from tasks.ablate.grid import families
from tasks.config import Config

INITS: tuple[Init, ...] = ("xavier", "gpt2")
"""The paper's init (the finding's condition) and the study's own (what a GPT-2-style model sees)."""


def depth_probe(cfg: Config) -> dict[str, Any]:
    """Per init: ``last_layer``: block -> depth -> seed -> the last block's gradient norm;
    ``per_layer``: block -> depth -> each block's norm, mean over seeds (JSON keys are strings)."""
    a = cfg.ablation
    xiong = families(cfg)["xiong"].fixed
    paper = {k.split(".", 1)[1]: v for k, v in xiong.items() if k in ("model.init", "model.norm", "model.mlp")}
    model = dataclasses.replace(cfg.model, d_model=a.d_model, n_head=a.n_head, seq_len=a.seq_len, **paper)
    out: dict[str, Any] = {"depths": list(a.probe_depths), "seeds": list(a.all_seeds)}
    for init in INITS:
        out[init] = _sweep(dataclasses.replace(model, init=init), cfg)
    return out


def _sweep(model: ModelConfig, cfg: Config) -> dict[str, Any]:
    a = cfg.ablation
    last: dict[str, dict[str, dict[str, float]]] = {}
    per_layer: dict[str, dict[str, list[float]]] = {}
    for block in a.blocks:
        for depth in a.probe_depths:
            norms = {
                seed: gradient_norms_at_init(model, depth, block, (seed,), a.batch_size, cfg.tokenizer.vocab_size)
                for seed in a.all_seeds
            }
            last.setdefault(block, {})[str(depth)] = {str(s): n[f"block{depth - 1}"] for s, n in norms.items()}
            per_layer.setdefault(block, {})[str(depth)] = [
                float(np.mean([n[f"block{i}"] for n in norms.values()])) for i in range(depth)
            ]
    return {"last_layer": last, "per_layer": per_layer}
