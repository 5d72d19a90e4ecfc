"""Which way of packing several small arms onto one GPU brings the most arms per GPU-minute (#48):
K arms of the gpu profile's ablation shape (d_model 256, 4 layers, seq 256, batch 32, fp32 as the
arms train), each its own weights, batch and AdamW, trained at once

- as K processes (the window's way: ``tasks/gpu_study/window.py`` starts one ``tasks.ablate.arm``
  each), started together and counted over the same wall interval;
- as K threads of one process, each on its own CUDA stream;
- as one ``torch.func.vmap`` step over the K stacked models, with the model's attention and with
  attention written out as matrix products.

Beside them, candidates for a registered design change, as K processes: TF32 matmuls, a vocabulary
sized to the corpus, and ``torch.compile`` (which the gpu profile's arms use). The tokens are random
on the GPU: the data loader is not measured. Prints and appends one JSON line per configuration as
it finishes, so a window that closes early still brings back what it measured; needs only torch
and model/:

    python benchmarks/bench_gpu_packing.py --out benchmarks/out/gpu_packing.jsonl
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.bench_seed_batch import attention_as_matmuls, vectorised  # noqa: E402
from model.gpt import GPT  # noqa: E402
from model.private import run_private  # noqa: E402
from tasks.config import load_config  # noqa: E402

VOCAB = 50304  # the gpu profile's tokenizer when the rows were measured (8,192 since; SETTINGS has both)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: only to check the script itself


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@dataclasses.dataclass(frozen=True)
class Setting:
    mode: str  # processes | streams | vmap
    k: int
    vocab: int = VOCAB
    tf32: bool = False
    compile: bool = False
    attention: str = "sdpa"  # sdpa | matmuls (vmap only)


def arm_model(seed: int, vocab: int, device: str) -> GPT:
    a = load_config(ROOT / "params.yaml", "gpu")
    shape = dataclasses.replace(
        a.model,
        d_model=a.ablation.d_model,
        n_layer=a.ablation.n_layer,
        n_head=a.ablation.n_head,
        seq_len=a.ablation.seq_len,
    )
    torch.manual_seed(seed)
    return GPT(shape, dataclasses.replace(a.mup, parametrization="sp"), vocab).to(device)


def batch(k: int, s: Setting, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    a = load_config(ROOT / "params.yaml", "gpu").ablation
    shape = (k, a.batch_size, a.seq_len) if k else (a.batch_size, a.seq_len)
    return torch.randint(0, s.vocab, shape, device=device), torch.randint(0, s.vocab, shape, device=device)


def numerics(s: Setting) -> None:
    torch.backends.cuda.matmul.allow_tf32 = s.tf32
    torch.set_float32_matmul_precision("high" if s.tf32 else "highest")


def one_arm_step(model: Any, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    logits, _, _ = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def steps_between(step: Any, start_at: float, seconds: float, sync: Any) -> int:
    """Warm up until the shared start, then count the steps that finish inside the interval."""
    while time.time() < start_at:
        step()
    sync()
    n, end = 0, start_at + seconds
    while time.time() < end:
        step()
        n += 1
    sync()
    return n


def process_arm(seed: int, s: Setting, start_at: float, seconds: float) -> int:
    """One arm in its own process: what the window runs K of."""
    numerics(s)
    model = arm_model(seed, s.vocab, DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    fwd = torch.compile(model) if s.compile else model
    x, y = batch(0, s, DEVICE)
    return steps_between(lambda: one_arm_step(fwd, opt, x, y), start_at, seconds, sync)


def as_processes(s: Setting, seconds: float, lead: float) -> float:
    start_at = time.time() + lead
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(s.k, mp_context=ctx) as pool:
        steps = list(pool.map(process_arm, range(s.k), [s] * s.k, [start_at] * s.k, [seconds] * s.k))
    return sum(steps) / seconds


def as_streams(s: Setting, seconds: float, lead: float) -> float:
    numerics(s)
    counts, errors = [0] * s.k, []
    start_at = time.time() + lead

    def run(i: int) -> None:
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                model = arm_model(i, s.vocab, DEVICE)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
                x, y = batch(0, s, DEVICE)
                counts[i] = steps_between(lambda: one_arm_step(model, opt, x, y), start_at, seconds, stream.synchronize)
        except Exception as e:  # raised again in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(s.k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.empty_cache()
    if errors:
        raise errors[0]
    return sum(counts) / seconds


def as_vmap(s: Setting, seconds: float, lead: float) -> float:
    numerics(s)
    models = [arm_model(i, s.vocab, DEVICE) for i in range(s.k)]
    x, y = batch(s.k, s, DEVICE)
    sdpa = F.scaled_dot_product_attention
    if s.attention == "matmuls":
        F.scaled_dot_product_attention = attention_on_device  # the model calls it through F
    try:
        step = vectorised(models, x, y)
        return s.k * steps_between(step, time.time() + lead, seconds, sync) / seconds
    finally:
        F.scaled_dot_product_attention = sdpa
        del models, x, y
        torch.cuda.empty_cache()  # else this process's cache starves the process settings after it


def attention_on_device(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):  # noqa: ANN001, ANN201
    with torch.device(q.device):
        return attention_as_matmuls(q, k, v, attn_mask, dropout_p, is_causal, scale)


SETTINGS = [  # most telling first: a window may close before the last
    Setting("processes", 1),
    Setting("processes", 5),
    Setting("streams", 5),
    Setting("vmap", 5),
    Setting("vmap", 5, attention="matmuls"),
    Setting("processes", 5, vocab=8192),
    Setting("processes", 5, tf32=True),
    Setting("processes", 8),
    Setting("streams", 8),
    Setting("vmap", 8, attention="matmuls"),
    Setting("processes", 5, compile=True),
    Setting("vmap", 8, vocab=8192, attention="matmuls"),
    Setting("vmap", 8, tf32=True, attention="matmuls"),
]
RUNNERS = {"processes": as_processes, "streams": as_streams, "vmap": as_vmap}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=15.0, help="the counted interval of each setting")
    p.add_argument("--lead", type=float, default=20.0, help="seconds to start, build and warm up before it")
    p.add_argument("--compile-lead", type=float, default=90.0, help="the lead of a compiled setting")
    p.add_argument("--only", type=int, nargs="*", help="these settings (indices into SETTINGS) only")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/gpu_packing.jsonl")
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    header = {
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    print(json.dumps(header), flush=True)
    alone = None
    for s in [SETTINGS[i] for i in args.only] if args.only else SETTINGS:
        began = time.time()
        try:
            rate = RUNNERS[s.mode](s, args.seconds, args.compile_lead if s.compile else args.lead)
        except Exception as e:  # a mode this torch cannot run is a result too
            row = {**header, **dataclasses.asdict(s), "error": f"{type(e).__name__}: {e}"[:300]}
        else:
            alone = alone or rate
            row = {
                **header,
                **dataclasses.asdict(s),
                "arm_steps_per_s": round(rate, 2),
                "vs_one_arm_alone": round(rate / alone, 2) if alone else None,
            }
        row["wall_s"] = round(time.time() - began, 1)
        print(json.dumps(row), flush=True)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(run_private(main))
