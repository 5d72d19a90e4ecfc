"""The collapse check (seed 000: after a spike a model may emit repetitive or empty text):
sampled continuations and their distinct-n, empty and repeat rates."""

from __future__ import annotations

import torch

from model.gpt import GPT


@torch.no_grad()
def sample(model: GPT, prompts: torch.Tensor, n_tokens: int, seed: int = 0) -> list[list[int]]:
    """Sampled continuations (temperature 1, a fixed generator) of each prompt row."""
    generator = torch.Generator(device=prompts.device).manual_seed(seed)
    was_training = model.training
    model.eval()
    seq = prompts
    for _ in range(n_tokens):
        logits, _, _ = model(seq[:, -model.cfg.seq_len :])
        probs = torch.softmax(logits[:, -1].float(), dim=-1)
        seq = torch.cat([seq, torch.multinomial(probs, 1, generator=generator)], dim=1)
    model.train(was_training)
    return seq[:, prompts.shape[1] :].tolist()


def collapse_stats(generations: list[list[int]], eot: int, n: int = 2) -> dict[str, float]:
    """distinct-n (unique n-grams / n-grams, over all generations), the share of generations that
    end at once (first token end-of-text: empty output), and the share of repeated tokens."""
    grams = [tuple(g[i : i + n]) for g in generations for i in range(len(g) - n + 1)]
    tokens = [t for g in generations for t in g]
    return {
        "distinct_2": len(set(grams)) / len(grams) if grams else 0.0,
        "empty_rate": sum(1 for g in generations if not g or g[0] == eot) / max(1, len(generations)),
        "repeat_rate": 1 - len(set(tokens)) / len(tokens) if tokens else 0.0,
    }
