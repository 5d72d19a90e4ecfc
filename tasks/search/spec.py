"""What the μP LR search trains: the grid, the widths, each trial's config and the studies.

One study per (parametrization, width) over the widths of ``search.widths`` plus the target width
(``model.d_model``, pretrain's), named ``<experiment>/search/<p>/w<width>/<digest>``; the digest
covers everything else that decides a trial's numbers (the training config, the grid, the data),
so a changed config starts fresh studies and an unchanged one finds its finished trials. After
them, a ``transfer`` study trains the target width at the transferred LR once per seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence

import numpy as np

from model.config import CheckpointConfig, Parametrization
from model.flops import training_flops
from model.typed_config import ConfigError
from tasks.config import Config
from tasks.search.groups import MedianRule


def lr_grid(cfg: Config) -> list[float]:
    """The log2 LRs of the grid, evenly spaced from ``log2_lr_min`` to ``log2_lr_max``."""
    s = cfg.search
    return [round(float(x), 6) for x in np.linspace(s.log2_lr_min, s.log2_lr_max, s.lr_points)]


def refine_lrs(grid: Sequence[float], best: float, n: int) -> list[float]:
    """The ``n`` LRs the second stage adds around ``best``, a grid LR (search.refine_points): n/2
    evenly inside each grid step beside it, none past the grid's ends (an optimum there stays a
    bound: tasks/search/fit.py, censoring)."""
    if len(grid) < 2:
        return []
    step = (grid[-1] - grid[0]) / (len(grid) - 1)
    side = n // 2
    lrs = [best + sign * step * k / (side + 1) for sign in (-1, 1) for k in range(1, side + 1)]
    return sorted(round(lr, 6) for lr in lrs if grid[0] < lr < grid[-1])


def target_width(cfg: Config) -> int:
    return cfg.model.d_model


def swept_widths(cfg: Config) -> list[int]:
    """Every width with a study: the configured ones and the target (the direct sweep)."""
    return sorted({*cfg.search.widths, target_width(cfg)})


def proxy_widths(cfg: Config) -> list[int]:
    """The widths the LR is transferred from: those below the target (at least one)."""
    proxies = [w for w in swept_widths(cfg) if w < target_width(cfg)]
    if not proxies:
        raise ConfigError(
            f"search.widths: {cfg.search.widths} has no proxy width below the target "
            f"model.d_model={target_width(cfg)}, to transfer the LR from"
        )
    return proxies


def trial_config(cfg: Config, parametrization: Parametrization, width: int, log2_lr: float, seed: int) -> Config:
    """Pretrain's training config at another width, parametrization, LR and seed, for the
    search's steps and batch, with one torch thread and no checkpoints. Built section by section:
    the spike and checkpoint keys refer to pretrain's steps, not a trial's."""
    s = cfg.search
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, d_model=width),
        mup=dataclasses.replace(cfg.mup, parametrization=parametrization),
        optim=dataclasses.replace(cfg.optim, lr=2.0**log2_lr),
        schedule=dataclasses.replace(cfg.schedule, warmup_steps=min(cfg.schedule.warmup_steps, s.steps // 5)),
        train=dataclasses.replace(
            cfg.train,
            steps=s.steps,
            batch_size=s.batch_size,
            grad_accum=1,
            seed=seed,
            eval_every=s.eval_every,
            cpu_threads=1,
            num_workers=0,
        ),
        checkpoint=CheckpointConfig(every_steps=0, milestones=[]),
    )


def trial_cost(cfg: Config, spec: StudySpec) -> float:
    """The training FLOPs of one trial of ``spec`` (its width; every point trains as many steps)."""
    lr, seed = spec.points[0]
    return training_flops(trial_config(cfg, spec.parametrization, spec.width, lr, seed))


def uniform_loss(cfg: Config) -> float:
    """ln(vocab_size): the loss of a uniform guess, and of a μP model at init."""
    return math.log(cfg.tokenizer.vocab_size)


def prune_bound(cfg: Config) -> float:
    """``search.prune_above``, by default a nat above the loss of a uniform guess."""
    return cfg.search.prune_above or uniform_loss(cfg) + 1.0


def median_rule(cfg: Config) -> MedianRule | None:
    """The median rule's settings (``search.prune_*``), None when ``search.prune_median`` is off."""
    s = cfg.search
    return MedianRule(s.prune_startup_trials, s.prune_warmup_steps) if s.prune_median else None


def search_digest(cfg: Config, data: dict[str, str]) -> str:
    """What decides a trial's numbers besides its width, parametrization, LR and seed. The median
    rule's settings are in it when the rule is on (which trials end, and so the fits, depend on
    them); without it the digest is that of the studies of before the rule."""
    base = trial_config(cfg, "sp", 0, 0.0, 0).to_flat_dict()
    varied = {"model.d_model", "mup.parametrization", "optim.lr", "train.seed"}
    spec = {
        "config": {
            k: v
            for k, v in base.items()
            if k.split(".")[0] in ("tokenizer", "model", "mup", "optim", "schedule", "precision", "train")
            and k not in varied
        },
        "search": {
            "grid": lr_grid(cfg),
            "seeds": cfg.search.all_seeds,
            "prune_above": prune_bound(cfg),
            **({"refine_points": cfg.search.refine_points} if cfg.search.refine_points else {}),
            **({"median": dataclasses.asdict(rule)} if (rule := median_rule(cfg)) else {}),
        },
        "data": data,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:8]


@dataclasses.dataclass(frozen=True)
class StudySpec:
    """One study: what it trains and which points it holds."""

    name: str
    kind: str  # "sweep" or "transfer"
    parametrization: Parametrization
    width: int
    points: tuple[tuple[float, int], ...]  # (log2 LR, seed)

    @property
    def log2_lr_range(self) -> tuple[float, float]:
        lrs = [lr for lr, _ in self.points]
        return min(lrs), max(lrs)


def sweep_specs(cfg: Config, digest: str) -> list[StudySpec]:
    """The grid studies, widest first (so the longest trials start first)."""
    points = tuple((lr, seed) for lr in lr_grid(cfg) for seed in cfg.search.all_seeds)
    return [
        StudySpec(f"{cfg.tracking.experiment}/search/{p}/w{w}/{digest}", "sweep", p, w, points)
        for w in reversed(swept_widths(cfg))
        for p in cfg.search.parametrizations
    ]


def transfer_spec(cfg: Config, digest: str, log2_lr: float) -> StudySpec:
    points = tuple((round(log2_lr, 6), seed) for seed in cfg.search.all_seeds)
    p = cfg.mup.parametrization
    return StudySpec(
        f"{cfg.tracking.experiment}/transfer/{p}/w{target_width(cfg)}/{digest}",
        "transfer",
        p,
        target_width(cfg),
        points,
    )
