"""The conditions two findings need before their mechanism can operate, each measured by a probe
as tasks/design/preregistration.yaml registers it (fp16: ``condition``; overflow: ``condition``):

  loss shift   fp16 underflow (Micikevicius et al. 2017) needs activation gradients in fp16's
               subnormal range, and this study's small models had 0.046 % of them there. The
               precision family's loss is multiplied by 2^-k, k the smallest shift at which a
               one-step probe of the family's base arm puts ``ablation.underflow_target`` of the
               worst block's activation gradients below 2^-24. fp32 and bf16 are unchanged by it
               (Adam's ε scales alike); fp16 without scaling loses what the paper says it loses.
  overflow     fp16's forward pass overflows (65,504) where bf16's does not. At the injection step
               an arm multiplies block 0's weight matrices by the smallest power of two that takes
               its own fp16 forward pass on a fixed validation batch past the range
               (:class:`OverflowProbeSpike`): the same excursion for both formats, sized by a probe.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from model.callbacks import TrainerView
from model.data import Tokens, open_split
from model.probes import overflow_multiplier, underflow_by_shift
from model.spike.injections import ParamSpike
from model.train import Trainer
from tasks.ablate.grid import arm_config, families, family_arm
from tasks.config import Config
from tasks.runtime.outputs import MANIFEST

MAX_PROBE_SHIFT = 16
"""The largest loss shift the probe may choose: log2 of the loss scaler's initial scale (65,536),
so dynamic loss scaling undoes the shift from its first step, as the paper's scale factors did."""


def loss_shift_probe(cfg: Config, project: Path) -> dict[str, Any]:
    """The precision family's loss shift: one fp32 forward/backward of its base arm at init (first
    discovery seed, its first batch), the worst block's underflow share at each k in
    0..MAX_PROBE_SHIFT, and the smallest k reaching ``ablation.underflow_target`` (None: no k does,
    and the fp16 finding is not tested)."""
    a = cfg.ablation
    family = families(cfg)["precision"]
    base = arm_config(cfg, family_arm(family, a.seeds[0], precision="fp32"), family, loss_shift=0)
    manifest = project / MANIFEST
    trainer = Trainer(base, open_split(manifest, "train"), open_split(manifest, "val"))
    x, y = (t.to(trainer.device) for t in trainer.loader.next_batch())  # the loader yields CPU batches
    shares = underflow_by_shift(trainer.model, x, y, range(MAX_PROBE_SHIFT + 1))
    chosen = next((k for k, share in shares.items() if share >= a.underflow_target), None)
    return {
        "k": chosen,
        "target": a.underflow_target,
        "seed": a.seeds[0],
        "shares": {str(k): share for k, share in shares.items()},
    }


def probe_batch(val_tokens: Tokens, seq_len: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch the overflow probe measures on: the first ``batch_size`` windows of validation."""
    span = seq_len + 1
    rows = np.stack([val_tokens[i * span : (i + 1) * span].astype(np.int64) for i in range(batch_size)])
    chunk = torch.from_numpy(rows)
    return chunk[:, :-1], chunk[:, 1:]


class OverflowProbeSpike(ParamSpike):
    """The overflow family's injection: at its step, block ``param_block``'s weight matrices x the
    smallest power of two for which an emulated fp16 forward pass of the model as it is then, on
    ``batch``, goes non-finite while bf16's stays finite (model/probes.py: overflow_multiplier).
    ``multiplier`` records it (None until it struck, or when no power of two separates the formats:
    then nothing is injected and the finding's precondition reports it)."""

    name = "inject_overflow"

    def __init__(self, injection, batch: tuple[torch.Tensor, torch.Tensor]):
        super().__init__(injection)
        self.batch = batch
        self.multiplier: float | None = None

    @torch.no_grad()
    def apply(self, trainer: TrainerView, index: int) -> None:
        if index != 0:
            return
        x, y = (t.to(trainer.device) for t in self.batch)
        try:
            self.multiplier = overflow_multiplier(trainer.model, x, y, self.injection.param_block)
        except ValueError:
            return
        for p in trainer.model.block_matrices(self.injection.param_block):
            p.mul_(self.multiplier)

    def state_dict(self) -> dict[str, Any]:
        return {"multiplier": self.multiplier}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.multiplier = state["multiplier"]
