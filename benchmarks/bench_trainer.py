"""What the trainer costs, measured on the same model and batches.

  (a) overhead   tokens/s of train() with every telemetry metric, the CSV logger, the progress
                 output, scheduled checkpoints and a spike detector (model/detect.py: reads loss
                 and grad norm every step, on the device), over a bare loop (forward, backward,
                 clip, AdamW step, nothing else); targets >= 0.97 at the default cadence
                 (--steps 100), >= 0.95 with stats and a checkpoint every 15 steps (--steps 30). --mlflow adds the MLflow callback of
                 tasks/runtime/tracking.py (skipped when tasks.runtime.tracking or mlflow cannot be imported).
  (b) precision  step time of emulated bf16/fp16 and real bf16 autocast over fp32 on the CPU,
                 and the path ``emulate: auto`` chooses on this CPU.
  (c) checkpoints  time spent saving as a share of the trainer's wall time in (a).
  (d) MFU        of the trainer in (a) from model/flops.py; a number only on a GPU in the peak table
                 (``--device cuda --profile gpu`` trains the project's GPU profile in bf16).

The sizes come from params.yaml plus ``--profile`` (train.steps, checkpoints and evaluation are
set here). Timings cover steps ``--warmup``+1 .. steps-1: the window holds a layer-stats step and a
checkpoint (both at steps/2) but not the last step's evaluation. Each measurement is repeated
``--repeats`` times, alternating, and the best is kept. On the CPU the ratios use process CPU time
(one intra-op thread): wall time on cores shared with other jobs varies by ±20 % run to run, CPU
time by a few %; wall-clock figures are reported next to them.
Needs only torch, numpy, pyyaml, tqdm:

    python benchmarks/bench_trainer.py --out benchmarks/out/trainer_cpu.json
    python benchmarks/bench_trainer.py --device cuda --profile gpu --out benchmarks/out/trainer_gpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.callbacks import Callback, CSVLogger, ProgressBar  # noqa: E402
from model.data import TokenLoader  # noqa: E402
from model.detect import SpikeDetector  # noqa: E402
from model.flops import mfu, model_flops_per_token, peak_flops  # noqa: E402
from model.gpt import GPT  # noqa: E402
from model.optim import build_adamw, lr_at, set_lr  # noqa: E402
from model.precision import resolve_precision  # noqa: E402
from model.private import run_private  # noqa: E402
from model.step import TrainModule  # noqa: E402
from model.train import Trainer, resolve_device, train  # noqa: E402
from tasks.config import Config, load_config  # noqa: E402


def bench_config(args: argparse.Namespace) -> Config:
    params = ROOT / "params.yaml"
    cfg = load_config(params, args.profile) if params.is_file() else Config()
    steps, device = args.steps, resolve_device(args.device).type
    # A short run still sees every kind of work: layer stats and a checkpoint mid-run, a final
    # checkpoint, evaluation only at the end (and excluded from the timings).
    return cfg.replace(
        **{
            "train.steps": steps,
            "train.device": device,
            "train.eval_every": 0,
            "train.layer_stats_every": min(cfg.train.layer_stats_every, steps // 2),
            "train.cpu_threads": args.threads if device == "cpu" else 0,
            "schedule.warmup_steps": min(cfg.schedule.warmup_steps, steps // 4),
            "checkpoint.every_steps": steps // 2,
            "checkpoint.every_minutes": 0.0,
            "checkpoint.milestones": [],
        }
    )


def random_tokens(cfg: Config, steps: int) -> np.ndarray:
    t = cfg.train
    n = (steps + 1) * t.batch_size * t.grad_accum * (cfg.model.seq_len + 1)
    return np.random.default_rng(0).integers(0, cfg.tokenizer.vocab_size, n, dtype=np.int64).astype(np.uint32)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Window:
    """Wall and process CPU time between the ends of steps ``warmup`` and ``steps - 1``."""

    def __init__(self, cfg: Config, warmup: int):
        t = cfg.train
        self.first, self.last = warmup, t.steps - 1
        self.tokens = (self.last - self.first) * t.batch_size * t.grad_accum * cfg.model.seq_len

    def mark(self, step: int, device: torch.device) -> None:
        if step in (self.first, self.last):
            synchronize(device)
            now = (time.perf_counter(), time.process_time())
            if step == self.first:
                self.start = now
            else:
                self.wall, self.cpu = now[0] - self.start[0], now[1] - self.start[1]

    def rates(self) -> dict[str, float]:
        return {"tokens_per_s": self.tokens / self.wall, "tokens_per_cpu_s": self.tokens / self.cpu}


class WindowTimer(Callback):
    """Runs after every other callback (the checkpointer included), so their cost is inside."""

    order = 1000

    def __init__(self, window: Window):
        self.window = window

    def on_step_end(self, trainer: Trainer) -> None:
        self.window.mark(trainer.step, trainer.device)


def run_trainer(cfg: Config, tokens: np.ndarray, warmup: int, extra: list) -> dict[str, Any]:
    window = Window(cfg, warmup)
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        # The study attaches a spike detector to every run: it reads loss and grad norm each step.
        callbacks = [ProgressBar(), CSVLogger(Path(tmp) / "plots"), SpikeDetector(), WindowTimer(window), *extra]
        summary = train(cfg, tokens, tokens, Path(tmp) / "run", callbacks)
    return {
        **window.rates(),
        "checkpoint_time_share": summary["checkpoint_time_share"],
        "checkpoint_s": summary["checkpoint_s"],
        "wall_s": summary["wall_s"],
    }


def run_bare(cfg: Config, tokens: np.ndarray, warmup: int) -> dict[str, Any]:
    """Forward, backward, clip, AdamW step: the floor any trainer is measured against."""
    t, device = cfg.train, resolve_device(cfg.train.device)
    torch.manual_seed(t.seed)
    model = GPT(cfg.model, cfg.mup, cfg.tokenizer.vocab_size).to(device)
    forward = torch.compile(model) if t.compile else model
    optimizer = build_adamw(model, cfg.optim)
    precision = resolve_precision(cfg.precision, device.type)
    scaler = precision.grad_scaler(cfg.precision)
    loader = TokenLoader(tokens, cfg.model.seq_len, t.batch_size, t.seed, t.num_workers, t.pin_memory)
    window = Window(cfg, warmup)
    for step in range(t.steps):
        window.mark(step, device)  # == the end of step `step` in the trainer's 1-based count
        set_lr(optimizer, lr_at(step, cfg.optim.lr, t.steps, cfg.schedule))
        for _ in range(t.grad_accum):
            x, y = (b.to(device, non_blocking=t.pin_memory) for b in loader.next_batch())
            with precision.autocast():
                _, ce, z = forward(x, y)
            scaler.scale((ce + z) / t.grad_accum).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return window.rates()


def mlflow_callback() -> tuple[Any, Any] | None:
    """(callback, mlflow module) when tasks.runtime.tracking and mlflow import; None otherwise."""
    try:
        import mlflow

        from tasks.runtime.tracking import MLflowMetrics
    except Exception as e:  # noqa: BLE001 -- any import problem means "not available here"
        print(f"--mlflow: skipped ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    return MLflowMetrics(), mlflow


def bench_overhead(cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    tokens = random_tokens(cfg, args.steps)
    tracker = mlflow_callback() if args.mlflow else None
    runs: dict[str, list[dict[str, Any]]] = {"bare": [], "trainer": [], "trainer+mlflow": []}
    for _ in range(args.repeats):  # alternate, so a busy moment of a shared CPU hits all alike
        runs["bare"].append(run_bare(cfg, tokens, args.warmup))
        runs["trainer"].append(run_trainer(cfg, tokens, args.warmup, []))
        if tracker is not None:
            callback, mlflow = tracker
            with tempfile.TemporaryDirectory() as tmp:
                mlflow.set_tracking_uri(f"sqlite:///{tmp}/mlflow.db")
                with mlflow.start_run(run_name="bench_trainer"):
                    runs["trainer+mlflow"].append(run_trainer(cfg, tokens, args.warmup, [callback]))
    key = "tokens_per_cpu_s" if cfg.train.device == "cpu" else "tokens_per_s"
    out = {}
    for name, samples in runs.items():
        if samples:
            best = max(samples, key=lambda m: m[key])
            out[name] = {
                **best,
                "samples": samples,
                "ratio_to_bare": best[key] / max(r[key] for r in runs["bare"]),
                "wall_ratio_to_bare": best["tokens_per_s"] / max(r["tokens_per_s"] for r in runs["bare"]),
            }
    return out


def bench_precision(cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    """CPU ms per train_step (fixed batches, after warm-up) of each precision, best of the repeats."""
    modes = {
        "fp32": ("fp32", "never"),
        "bf16 emulated": ("bf16", "always"),
        "fp16 emulated": ("fp16", "always"),
        "bf16 autocast (real)": ("bf16", "never"),
        "bf16 emulate:auto": ("bf16", "auto"),
    }
    device = resolve_device(cfg.train.device)
    torch.manual_seed(0)
    batches = [
        (torch.randint(0, cfg.tokenizer.vocab_size, (cfg.train.batch_size, cfg.model.seq_len), device=device),) * 2
        for _ in range(cfg.train.grad_accum)
    ]
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.repeats):
        for name, (mode, emulate) in modes.items():
            c = cfg.replace(**{"precision.mode": mode, "precision.emulate": emulate})
            model = GPT(c.model, c.mup, c.tokenizer.vocab_size).to(device)
            optimizer = build_adamw(model, c.optim)
            precision = resolve_precision(c.precision, device.type)
            scaler = precision.grad_scaler(c.precision)
            module = TrainModule(model, optimizer, scaler, precision, c.optim.grad_clip)
            n = args.precision_steps
            for i in range(1 + n):  # the first step (allocations, lazy init) is not timed
                if i == 1:
                    start = time.process_time()
                module.step(i + 1, batches)
            times[name].append(1e3 * (time.process_time() - start) / n)
    fp32 = min(times["fp32"])
    return {name: {"ms_per_step": min(t), "ratio_to_fp32": min(t) / fp32, "samples": t} for name, t in times.items()}


def describe(cfg: Config, device: torch.device) -> dict[str, Any]:
    model = GPT(cfg.model, cfg.mup, cfg.tokenizer.vocab_size)
    m, t = cfg.model, cfg.train
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "profile": cfg.profile,
        "precision": resolve_precision(cfg.precision, device.type).describe(),
        "bf16_auto": resolve_precision(cfg.precision.__class__(mode="bf16"), device.type).describe(),
        "n_layer": m.n_layer,
        "d_model": m.d_model,
        "n_head": m.n_head,
        "seq_len": m.seq_len,
        "vocab_size": cfg.tokenizer.vocab_size,
        "batch_size": t.batch_size,
        "grad_accum": t.grad_accum,
        "compile": t.compile,
        "steps": t.steps,
        "log_every": t.log_every,
        "layer_stats_every": t.layer_stats_every,
        "checkpoint_every_steps": cfg.checkpoint.every_steps,
        "params": model.num_params(non_embedding=False),
        "flops_per_token": model_flops_per_token(model),
        "peak_flops": peak_flops(device),
    }


def print_table(result: dict[str, Any]) -> None:
    s = result["setup"]
    print(
        f"\nspikelab trainer benchmark: {s['device_name']} ({s['device']}, {s['threads']} thread(s)), "
        f"torch {s['torch']}, profile {s['profile']}, {s['precision']}"
    )
    print(
        f"model {s['n_layer']}x{s['d_model']} (heads {s['n_head']}), seq {s['seq_len']}, batch "
        f"{s['batch_size']}x{s['grad_accum']}, {s['params'] / 1e6:.2f}M params, "
        f"{s['flops_per_token'] / 1e6:.1f} MFLOP/token, {s['steps']} steps "
        f"(log every {s['log_every']}, layer stats every {s['layer_stats_every']}, "
        f"checkpoint every {s['checkpoint_every_steps']})\n"
    )
    o = result["overhead"]
    basis = "CPU time" if s["device"] == "cpu" else "wall time"
    print(f"(a) overhead{'':<16}{'tokens/s':>10}{'tokens/CPU-s':>14}{'ratio':>8}{'wall ratio':>12}")
    for name in ("bare", "trainer", "trainer+mlflow"):
        if name in o:
            m = o[name]
            print(
                f"    {name:<24}{m['tokens_per_s']:>10,.0f}{m['tokens_per_cpu_s']:>14,.0f}"
                f"{m['ratio_to_bare']:>8.3f}{m['wall_ratio_to_bare']:>12.3f}"
            )
    print(f"    ratio: trainer (+ spike detector) / bare loop by {basis}")
    if "precision" in result:
        print(f"(b) precision{'':<15}{'CPU ms/step':>12}{'ratio to fp32':>16}")
        for name, p in result["precision"].items():
            print(f"    {name:<24}{p['ms_per_step']:>12.1f}{p['ratio_to_fp32']:>16.2f}")
        print(f"    emulate:auto chose: {result['setup']['bf16_auto']}")
    t = o["trainer"]
    print(
        f"(c) checkpoint share         {100 * t['checkpoint_time_share']:.2f} % of wall "
        f"({t['checkpoint_s']:.3f} s of {t['wall_s']:.2f} s)"
    )
    d = result["mfu"]
    if d["mfu"] is None:
        print(
            f"(d) MFU                      n/a (no peak for {s['device_name']}); achieved "
            f"{d['achieved_flops'] / 1e9:.2f} GFLOP/s"
        )
    else:
        print(
            f"(d) MFU                      {100 * d['mfu']:.1f} % ({d['achieved_flops'] / 1e12:.1f} of "
            f"{d['peak_flops'] / 1e12:.0f} TFLOP/s)"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: cuda when available (default: %(default)s)",
    )
    p.add_argument("--profile", default=None, help="config profile in profiles/ (default: params.yaml's)")
    p.add_argument("--steps", type=int, default=30, help="steps per timed run (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="untimed first steps (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="alternating repeats, best kept (default: %(default)s)")
    p.add_argument("--precision-steps", type=int, default=4, help="timed steps per precision (default: %(default)s)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU intra-op threads (default: %(default)s; shared cores make more slower)",
    )
    p.add_argument("--mlflow", action="store_true", help="also time the trainer with the MLflow callback")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    if not 2 <= args.warmup + 2 <= args.steps:
        p.error("--steps must exceed --warmup by at least 2")

    cfg = bench_config(args)
    device = resolve_device(cfg.train.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"setup": describe(cfg, device), "overhead": bench_overhead(cfg, args)}
    if device.type == "cpu":
        result["precision"] = bench_precision(cfg, args)
    tokens_per_s = result["overhead"]["trainer"]["tokens_per_s"]
    flops_per_token = result["setup"]["flops_per_token"]
    result["mfu"] = {
        "tokens_per_s": tokens_per_s,
        "achieved_flops": tokens_per_s * flops_per_token,
        "peak_flops": peak_flops(device),
        "mfu": mfu(tokens_per_s, flops_per_token, peak_flops(device)),
    }
    print_table(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_private(main))
