"""One ablation arm: the trainer on one thread with the spike detector, a per-step trace (loss,
pre-clip grad norm, update RMS, flags), per-layer trajectories, and, where asked, an injected
weight excursion (the overflow family's) and the fp16 range probe; writes ``<out>/result.json``.

    python -m tasks.ablate.arm --profile default --out runs/ablate/arms/manual \\
        --set model.block=post_ln --set schedule.warmup_steps=0 ... [--spike lr] [--range-probe-every 100] \\
        [--policy skip_step]

The ablate stage trains every arm as this command would, in a long-lived worker process
(:func:`run_command`, tasks/runtime/workers.py); the command is in the arm's MLflow run (tag
``spikelab.command``), so any arm reproduces by itself, bitwise on the CPU. Imports only torch and
model/ (no tracking, no orchestration). Exit codes are the
trainer's (model/stops.py): 0 completed, 3 diverged (a result), 2 a bad config, anything else a
crash the stage retries; a rerun resumes from the arm's newest checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, get_args

import numpy as np
import torch

from model.callbacks import Callback
from model.collapse import collapse_stats, sample
from model.data import open_split
from model.detect import SpikeDetector
from model.private import run_private
from model.probes import RangeProbe
from model.provenance import provenance
from model.spike.injections import Injection
from model.spike.policies import make_policy
from model.spike.records import Trace
from model.stops import EXIT_CODES
from model.train import train
from model.typed_config import UserError, add_config_arguments, parse_sets
from tasks.ablate.conditions import OverflowProbeSpike, probe_batch
from tasks.ablate.config import NaturalPolicy
from tasks.ablate.grid import arm_key, code_digest, data_hashes, injection_spec
from tasks.config import Config, load_config
from tasks.design.families import SPIKES

MANIFEST = Path("data/tokens/manifest.json")
SPIKE_PROBE_STEPS = 10
"""Steps after an injected spike that the range probe measures too: where activations overflow."""


class ArmTrace(Trace):
    """The trace of every step (loss, pre-clip grad norm, Adam's update RMS, skipped, flagged by the
    detector), kept in checkpoints so a resumed arm still has its whole curve."""

    name = "arm_trace"

    def __init__(self, detector) -> None:
        super().__init__()
        self.detector = detector
        self.saved: list[dict[str, Any]] = []  # the rows a checkpoint held

    def on_after_step(self, trainer, result) -> None:
        skipped = (result.vetoed | result.skipped | result.overflow).float()
        flagged = self.detector.now.float()
        rms = trainer.update_rms().to(result.loss.device)
        values = torch.stack([result.loss.float(), result.grad_norm.float(), rms.float(), skipped, flagged])
        self.rows.append((trainer.step, values))

    def read(self) -> list[dict[str, Any]]:
        if not self.rows:
            return list(self.saved)
        values = torch.stack([v for _, v in self.rows]).tolist()
        fresh = [
            {
                "step": s,
                "loss": _finite(v[0]),
                "grad_norm": _finite(v[1]),
                "update_rms": _finite(v[2]),
                "skipped": bool(v[3]),
                "flagged": bool(v[4]),
            }
            for (s, _), v in zip(self.rows, values)
        ]
        return [*self.saved, *fresh]

    def state_dict(self) -> dict[str, Any]:
        return {"rows": json.dumps(self.read())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved, self.rows = json.loads(state["rows"]), []


LAYER_TRAJECTORIES = ("stats/attn_logit_max/", "stats/attn_entropy/", "stats/logits/log_z")
"""The per-layer statistics (model/telemetry.py) an arm keeps over training, not only their extremes:
what Wortsman et al. watch (attention-logit growth, output log Z) and seed 002's entropy collapse."""


class LogitStats(Callback):
    """The trajectories of :data:`LAYER_TRAJECTORIES` at every layer-stats step, and their extremes
    over the run: the largest attention logit and output logit, log Z's largest and smallest, the
    lowest attention entropy."""

    name = "logit_stats"

    def __init__(self) -> None:
        self.stats: dict[str, float] = {}
        self.trajectories: list[dict[str, float | None]] = []

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        kept = {k: v for k, v in metrics.items() if k.startswith(LAYER_TRAJECTORIES)}
        if kept:
            self.trajectories.append({"step": step, **{k: _finite(v) for k, v in kept.items()}})
        for key, value, pick in (
            ("attn_logit_max", _max_of(metrics, "stats/attn_logit_max/"), max),
            ("logits_max", metrics.get("stats/logits/max"), max),
            ("log_z_max", metrics.get("stats/logits/log_z"), max),
            ("log_z_min", metrics.get("stats/logits/log_z"), min),
            ("attn_entropy_min", _min_of(metrics, "stats/attn_entropy/"), min),
        ):
            if value is not None and math.isfinite(value):
                self.stats[key] = pick(self.stats.get(key, value), value)

    def state_dict(self) -> dict[str, Any]:
        return {"stats": dict(self.stats), "trajectories": json.dumps(self.trajectories)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats = {k: float(v) for k, v in state["stats"].items()}
        self.trajectories = json.loads(state["trajectories"])


def _max_of(metrics: dict[str, float], prefix: str) -> float | None:
    values = [v for k, v in metrics.items() if k.startswith(prefix)]
    return max(values) if values else None


def _min_of(metrics: dict[str, float], prefix: str) -> float | None:
    values = [v for k, v in metrics.items() if k.startswith(prefix)]
    return min(values) if values else None


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def run_arm(
    cfg: Config,
    project: Path,
    out: Path,
    spike: str = "none",
    range_every: int = 0,
    data: Path = MANIFEST.parent,
    policy: str = "none",
) -> dict[str, Any]:
    """Train the arm ``cfg`` describes into ``out`` on the tokenize output in ``data`` (relative to
    ``project``), with ``spike`` (tasks/ablate/grid.py: injection_spec), the fp16 range probe
    every ``range_every`` steps (0: none) and a recovery ``policy`` acting on its detector's flags
    (none: the detector only records); returns (and writes) its result."""
    manifest = project / data / MANIFEST.name
    key = arm_key(cfg, data_hashes(manifest), code_digest(), spike, range_every, policy)
    train_tokens, val_tokens = open_split(manifest, "train"), open_split(manifest, "val")
    probes = ArmProbes(cfg, manifest, val_tokens, spike, range_every, policy)
    summary = train(cfg, train_tokens, val_tokens, out, probes.callbacks, identity=key)
    result = probes.record(key, summary)
    write_result(out / "result.json", result)
    return result


def arm_detector(cfg: Config) -> SpikeDetector:
    """The arms' spike detector: version 3's trailing window (no lag) at ``ablation.detect_zscore``.
    Its flags are the β₂ family's registered spikes_per_1k and what the natural-spike policies react
    to; the spike study's lagged detector (``spike.detect_lag``, ``spike.detect_zscore``) is
    calibrated for its ramped poison apart from it (tasks/spike/sizing.py)."""
    s = cfg.spike
    return SpikeDetector(
        window=s.detect_window, warmup=s.detect_warmup, zscore=cfg.ablation.detect_zscore, ratio=s.detect_ratio
    )


class ArmProbes:
    """The callbacks an arm trains with and its result record built from what they saw: one arm's
    (:func:`run_arm`) and each arm's of a fused group (tasks/ablate/fused.py) alike."""

    def __init__(
        self,
        cfg: Config,
        manifest: Path,
        val_tokens: Any,
        spike: str = "none",
        range_every: int = 0,
        policy: str = "none",
    ):
        self.cfg = cfg
        self.spec = injection_spec(spike, cfg.ablation)
        self.detector = arm_detector(cfg)
        # A policy reacts to the detector's flags (no injection to swap out): until the first flag
        # the run is the policy-free arm's, bitwise.
        self.policy = [make_policy(policy, self.detector, cfg.recovery, None)] if policy != "none" else []
        self.trace, self.stats = ArmTrace(self.detector), LogitStats()
        spec = self.spec
        after_spike = range(spec["start"], spec["start"] + spec["duration"] + SPIKE_PROBE_STEPS) if spec else ()
        self.ranges = [RangeProbe(range_every, after_spike)] if range_every else []
        self.injection = (
            [OverflowProbeSpike(Injection(**spec), probe_batch(val_tokens, cfg.model.seq_len, cfg.train.batch_size))]
            if spec
            else []
        )
        self.end = EndProbe(val_tokens, json.loads(manifest.read_text())["eot_id"])
        self.callbacks = [*self.injection, self.detector, *self.policy, self.trace, self.stats, *self.ranges, self.end]

    def record(self, key: str, summary: dict[str, Any]) -> dict[str, Any]:
        """The arm's result, as ``result.json`` holds it."""
        return {
            "key": key,
            "summary": summary,
            "rows": self.trace.read(),
            "stats": self.stats.stats,
            "trajectories": self.stats.trajectories,
            "ranges": [row._asdict() for row in self.ranges[0].rows] if self.ranges else [],
            "injection": self.spec,
            "injected_multiplier": self.injection[0].multiplier if self.injection else None,
            "policy": self.policy[0].kind if self.policy else None,
            "actions": self.policy[0].actions if self.policy else [],
            "init_loss": math.log(self.cfg.tokenizer.vocab_size),
            "collapse": self.end.collapse,
            "weights_sha256": self.end.weights_sha256,
            "provenance": self.end.provenance,
        }


class EndProbe(Callback):
    """After the run: a digest of the final weights (bitwise reproduction is checked on it), the
    arithmetic that produced them (model/provenance.py; taken while the trainer's thread count
    holds, on the machine that ran the arm), and, for a run that completed, the collapse of greedy samples from validation prompts (seed 000:
    repetitive or empty generations)."""

    name = "end_probe"

    def __init__(self, val_tokens, eot: int, prompts: int = 4, tokens: int = 32) -> None:
        self.val_tokens, self.eot, self.prompts, self.tokens = val_tokens, eot, prompts, tokens
        self.completed = False
        self.collapse: dict[str, float] = {}
        self.weights_sha256: str | None = None
        self.provenance: dict[str, Any] | None = None

    def on_train_end(self, summary: dict[str, Any]) -> None:
        self.completed = summary["status"] == "completed"

    def on_close(self, trainer) -> None:
        self.weights_sha256 = weights_digest(trainer.model)
        self.provenance = provenance(trainer.precision)
        if self.completed:
            span = trainer.cfg.model.seq_len + 1
            starts = np.stack([self.val_tokens[i * span : i * span + 8].astype(np.int64) for i in range(self.prompts)])
            generations = sample(trainer.model, torch.from_numpy(starts).to(trainer.device), self.tokens)
            self.collapse = collapse_stats(generations, self.eot)


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode() + tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Strict JSON (NaN and inf as null), written whole or not at all."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_strict(result), indent=1, allow_nan=False))
    os.replace(tmp, path)


def _strict(value: Any) -> Any:
    if isinstance(value, float):
        return _finite(value)
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tasks.ablate.arm", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the arm's directory: checkpoints/ and result.json")
    p.add_argument("--spike", default="none", choices=SPIKES, help="the injected spike (ablation.inject_*)")
    p.add_argument("--range-probe-every", type=int, default=0, help="steps between fp16 range probes (0: none)")
    p.add_argument(
        "--policy",
        default="none",
        choices=["none", *get_args(NaturalPolicy)],
        help="a recovery policy acting on the detector's flags (ablation.natural_policies)",
    )
    p.add_argument(
        "--data", default=str(MANIFEST.parent), help="the tokenize output to train on (data/perturbed: sensitivity's)"
    )
    add_config_arguments(p)
    return p


def run_command(arguments: list[str], project: Path | None = None) -> dict[str, Any]:
    """Train the arm that ``python -m tasks.ablate.arm <arguments>`` trains, in this process (a
    worker's), its paths taken from ``project`` (default: the working directory); returns its
    result. Raises :class:`UserError` on a bad config, as the command exits 2."""
    args = parser().parse_args(arguments)
    project = project or Path.cwd()
    params = project / args.params
    cfg = load_config(params, args.profile, parse_sets(args.sets))
    return run_arm(
        cfg,
        params.resolve().parent,
        project / args.out,
        args.spike,
        args.range_probe_every,
        Path(args.data),
        args.policy,
    )


def main(argv: list[str] | None = None) -> int:
    try:
        summary = run_command(sys.argv[1:] if argv is None else argv)["summary"]
    except UserError as e:
        print(f"spikelab: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: summary[k] for k in ("status", "diverged_at", "steps", "final_loss", "val_loss")}))
    return EXIT_CODES[summary["status"]]


if __name__ == "__main__":
    sys.exit(run_private(main))
