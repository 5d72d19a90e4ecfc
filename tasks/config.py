"""The study's config: the trainer's sections (model/config.py) plus each stage's own section,
loaded from ``params.yaml`` and a profile overlay, and the rules that tie the study together.

Where each section is declared, with its checks beside its fields:

  tokenizer model mup optim schedule precision train checkpoint   model/config.py
  data filter                                                     tasks/data/config.py
  spike recovery                                                  tasks/spike/config.py
  search                                                          tasks/search/config.py
  ablation                                                        tasks/ablate/config.py
  sensitivity                                                     tasks/sensitivity/config.py
  tracking executor                                               tasks/runtime/config.py

The rules across them (:meth:`Config.check_across`) are the study's, not the trainer's: a bare
``python -m model.train`` never sees them. The ``params`` stage (tasks/params.py) loads this
config first, so ``dvc repro`` fails on a broken rule before any stage's output is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.config import TrainingConfig, check_device
from model.typed_config import ConfigError, Resolved, from_dict, resolve
from tasks.ablate.config import AblationConfig
from tasks.data.config import DataConfig, FilterConfig
from tasks.runtime.config import ExecutorConfig, TrackingConfig
from tasks.runtime.paths import project_dir
from tasks.search.config import SearchConfig
from tasks.sensitivity.config import SensitivityConfig
from tasks.spike.config import RecoveryConfig, SpikeConfig


@dataclass(frozen=True)
class Config(TrainingConfig):
    """Everything a stage reads: the training sections, then the study's."""

    data: DataConfig = field(default_factory=DataConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    ablation: AblationConfig = field(default_factory=AblationConfig)
    sensitivity: SensitivityConfig = field(default_factory=SensitivityConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)

    def check_across(self) -> None:
        super().check_across()
        for step in self.checkpoint.milestones:
            if step > self.train.steps:
                raise ConfigError(f"checkpoint.milestones: step {step} is outside 1..train.steps={self.train.steps}")
        if self.data.max_doc_bytes < self.filter.max_chars:
            raise ConfigError(
                f"data.max_doc_bytes: {self.data.max_doc_bytes} is below filter.max_chars={self.filter.max_chars}"
            )
        self.check_spike_window()
        for width in self.search.widths:
            if width <= 0 or width % (2 * self.model.n_head):
                raise ConfigError(
                    f"search.widths: width {width} is not a positive multiple of 2·model.n_head="
                    f"{2 * self.model.n_head} (heads of even size)"
                )
        if self.mup.parametrization not in self.search.parametrizations:
            raise ConfigError(
                f"search.parametrizations: {self.search.parametrizations} lacks "
                f"mup.parametrization={self.mup.parametrization!r}, whose LR pretrain takes"
            )

    def check_spike_window(self) -> None:
        """The spike study's rules across sections: a rollback from the injection has a clean checkpoint
        to go back to (the warm-up is at least ``recovery.rollback_steps``), the window ends inside the
        origin run's schedule, a data injection (and each length the sizing rule may choose) ends at
        least ``recovery.recover_steps`` before the window does, and the injected block is one of the arm model's (the origin runs are at the ablation
        arm scale)."""
        s, r = self.spike, self.recovery
        if s.warm_steps < r.rollback_steps:
            raise ConfigError(
                f"spike.warm_steps: {s.warm_steps} is below recovery.rollback_steps={r.rollback_steps}; "
                f"a rollback from the injection would find no checkpoint that far back"
            )
        end = s.origin_step + s.warm_steps + r.eval_steps
        if end > s.run_steps:
            raise ConfigError(
                f"spike.run_steps: {s.run_steps} ends before the window does (spike.origin_step + "
                f"spike.warm_steps + recovery.eval_steps = {end})"
            )
        longest = r.eval_steps - r.recover_steps
        if s.poison_batches_range[1] > longest:
            raise ConfigError(
                f"spike.poison_batches_range: {s.poison_batches_range} reaches above recovery.eval_steps - "
                f"recovery.recover_steps = {longest}; its poison would still be served near the window's end"
            )
        if not 0 <= s.param_block < self.ablation.n_layer:
            raise ConfigError(f"spike.param_block: {s.param_block} is outside 0..ablation.n_layer-1")


def resolve_study(
    params: str | Path = "params.yaml", profile: str | None = None, overrides: dict[str, Any] | None = None
) -> Resolved[Config]:
    """The study's config and where its values came from (precedence: model/typed_config.py: resolve)."""
    return resolve(Config, params, profile, overrides)


def load_config(
    params: str | Path = "params.yaml", profile: str | None = None, overrides: dict[str, Any] | None = None
) -> Config:
    """The validated study config of ``params`` under a profile, with ``overrides`` (dotted keys) on top."""
    return resolve_study(params, profile, overrides).config


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    """A study config from a nested dict; missing keys take their defaults."""
    return from_dict(Config, raw, source)


def project_config(profile: str | None = None, overrides: dict[str, Any] | None = None) -> tuple[Config, Path]:
    """The validated config of the project a stage runs in (``overrides``: dotted keys, highest
    precedence), and that project's directory."""
    project = project_dir()
    return load_config(project / "params.yaml", profile, overrides), project


def check_runtime(cfg: Config) -> None:
    """The checks that need this machine, not just the files: call before anything is deleted
    or moved."""
    check_device(cfg.train.device)
