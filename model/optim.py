"""AdamW parameter groups (μP-aware) and the learning-rate schedule as a pure function of step."""

from __future__ import annotations

import math

import torch

from model.config import OptimConfig, ScheduleConfig
from model.gpt import GPT


def param_groups(model: GPT, cfg: OptimConfig) -> list[dict]:
    """Split parameters by role; each group carries ``lr_mult`` applied on top of the schedule.

    hidden matrices  lr × 1/m, wd × m   (μP: Adam's update size is width-independent only if the
                                         LR shrinks with fan-in; coupled decay steps by lr·wd,
                                         kept constant so decay strength does not change with
                                         width; independent decay steps by wd itself: × 1)
    embeddings       lr × 1, no decay unless ``decay_embeddings``
    readout          lr × 1, decayed like a matrix (μP divides its output by m instead)
    norms, biases    lr × 1, no decay unless ``decay_norms_and_biases``
    Under SP m = 1, so every group gets the base LR and weight decay. A group's decay is AdamW's
    ``weight_decay`` when coupled, its ``independent_decay`` (applied by the step, model/step.py)
    when independent; the other is 0.
    """
    m = model.width_mult
    coupled = cfg.weight_decay_mode == "coupled"
    embeddings = {id(model.wte.weight), id(model.wpe.weight)}
    readout = {id(model.readout.weight)} - embeddings  # tied readout counts as embedding
    groups: dict[str, dict] = {
        "hidden": {"params": [], "lr_mult": 1.0 / m, "decay": cfg.weight_decay * m if coupled else cfg.weight_decay},
        "embedding": {"params": [], "lr_mult": 1.0, "decay": cfg.weight_decay if cfg.decay_embeddings else 0.0},
        "readout": {"params": [], "lr_mult": 1.0, "decay": cfg.weight_decay},
        "vector": {"params": [], "lr_mult": 1.0, "decay": cfg.weight_decay if cfg.decay_norms_and_biases else 0.0},
    }
    seen: set[int] = set()
    for p in model.parameters():  # parameters() yields a tied tensor once
        if id(p) in seen:
            continue
        seen.add(id(p))
        role = (
            "embedding"
            if id(p) in embeddings
            else "readout"
            if id(p) in readout
            else "hidden"
            if p.ndim == 2
            else "vector"
        )
        groups[role]["params"].append(p)
    return [
        {
            "name": name,
            "lr": cfg.lr * g["lr_mult"],
            "params": g["params"],
            "lr_mult": g["lr_mult"],
            "weight_decay": g["decay"] if coupled else 0.0,
            "independent_decay": 0.0 if coupled else g["decay"],
        }
        for name, g in groups.items()
        if g["params"]
    ]


def build_adamw(model: GPT, cfg: OptimConfig, loss_multiplier: float = 1.0) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`. ``auto`` is the fused kernel on every device: it exists on
    the CPU too, is faster there than foreach, and can skip a non-finite step without a host sync.
    ε is scaled with the loss (``precision.loss_shift``): Adam's update is then unchanged."""
    impl = "fused" if cfg.implementation == "auto" else cfg.implementation
    return torch.optim.AdamW(
        param_groups(model, cfg),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps * loss_multiplier,
        fused=impl == "fused" or None,
        foreach=impl == "foreach" if impl != "fused" else None,
    )


def lr_at(step: int, peak: float, total_steps: int, cfg: ScheduleConfig) -> float:
    """LR of optimizer step ``step`` (0-based): linear warmup to ``peak``, then the decay shape."""
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    floor = peak * cfg.min_lr_ratio
    if cfg.kind == "constant":
        return peak
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - 1 - cfg.warmup_steps))
    if cfg.kind == "linear":
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Apply a scheduled base LR to every group through its μP multiplier."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_mult"]
