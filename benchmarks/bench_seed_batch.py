"""Whether training an arm's seeds together makes the arms cheaper (issue 29: the arms run at about
a quarter of their matmul-bound limit): K seeds of one arm's model, each its own weights and batch,
trained one after another (the stage's way) against all K in one vectorised step
(``torch.func.vmap`` over the stacked weights, one AdamW over the stacked tensors), on one thread.

The vectorised step runs twice: with the model's attention as it is (``scaled_dot_product_attention``,
whose CPU kernel has no batching rule, so vmap loops over it) and with attention written out as
matrix products (which vmap batches). Same shapes, same optimizer; CPU seconds per step of all K
models, the speedup over one-after-another. Prints and writes JSON; needs only torch and model/:

    python benchmarks/bench_seed_batch.py --seeds 8 --out benchmarks/out/seed_batch.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.func import functional_call, grad_and_value, stack_module_state, vmap  # noqa: E402

from model.gpt import GPT  # noqa: E402
from model.private import run_private  # noqa: E402
from tasks.config import Config, load_config  # noqa: E402


def attention_as_matmuls(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):  # noqa: ANN001, ANN201
    """Causal attention in matrix products and a softmax: what vmap can batch (no dropout: the
    arms train without it)."""
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(q.size(-1)))
    t = q.size(-2)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def arm_models(cfg: Config, seeds: int, vocab: int) -> list[GPT]:
    """The grid's arm shape (``cfg.ablation``), one model per seed."""
    a = cfg.ablation
    shape = dataclasses.replace(cfg.model, d_model=a.d_model, n_layer=a.n_layer, n_head=a.n_head, seq_len=a.seq_len)
    mup = dataclasses.replace(cfg.mup, parametrization="sp")
    models = []
    for seed in range(seeds):
        torch.manual_seed(seed)
        models.append(GPT(shape, mup, vocab))
    return models


def one_after_another(models: list[GPT], x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]

    def step() -> None:
        for k, (model, opt) in enumerate(zip(models, optimizers, strict=True)):
            logits, _, _ = model(x[k])
            loss = F.cross_entropy(logits.flatten(0, 1), y[k].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    return step


def vectorised(models: list[GPT], x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    params, buffers = stack_module_state(models)  # each (K, ...)
    params = {k: v.detach() for k, v in params.items()}
    skeleton = copy.deepcopy(models[0]).to("meta")
    optimizer = torch.optim.AdamW(list(params.values()), lr=1e-3)

    def loss(p: dict[str, Any], b: dict[str, Any], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        logits, _, _ = functional_call(skeleton, (p, b), (xi,))
        return F.cross_entropy(logits.flatten(0, 1), yi.flatten())

    grads_and_loss = vmap(grad_and_value(loss))

    def step() -> None:
        grads, _ = grads_and_loss(params, buffers, x, y)
        for name, p in params.items():
            p.grad = grads[name]
        optimizer.step()

    return step


def cpu_seconds_per_step(step: Callable[[], None], steps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        step()
    start = time.process_time()
    for _ in range(steps):
        step()
    return (time.process_time() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=8, help="K: the seeds trained together")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/seed_batch.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    study = load_config(ROOT / "params.yaml", "default")
    models, cfg = arm_models(study, args.seeds, args.vocab), study.ablation
    x, y = (torch.randint(0, args.vocab, (args.seeds, cfg.batch_size, cfg.seq_len)) for _ in range(2))
    sdpa = F.scaled_dot_product_attention
    seconds = {"one after another": cpu_seconds_per_step(one_after_another(models, x, y), args.steps)}
    seconds["vmap, the model's attention"] = cpu_seconds_per_step(vectorised(models, x, y), args.steps)
    F.scaled_dot_product_attention = attention_as_matmuls  # the model calls it through F
    try:
        seconds["vmap, attention as matmuls"] = cpu_seconds_per_step(vectorised(models, x, y), args.steps)
    finally:
        F.scaled_dot_product_attention = sdpa
    base = seconds["one after another"]
    result = {
        "seeds": args.seeds,
        "shape": {"d_model": cfg.d_model, "n_layer": cfg.n_layer, "batch": cfg.batch_size, "seq_len": cfg.seq_len},
        "cpu_ms_per_step_of_all_seeds": {k: v * 1e3 for k, v in seconds.items()},
        "speedup": {k: base / v for k, v in seconds.items()},
        "torch": torch.__version__,
    }
    for name, s in seconds.items():
        print(f"{name:28s} {s * 1e3:7.1f} CPU-ms per step of {args.seeds} seeds  {base / s:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(run_private(main))
