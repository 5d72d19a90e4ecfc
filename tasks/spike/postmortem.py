"""Post-mortems (seed 004's "Loss-spike post-mortem template", section by section) and the spike
figures, from the first seed's :class:`tasks.spike.study.Study` (one incident write-up per
injection; the other seeds are the recovery finding's pairing units, in ``metrics/spike.json``).

The numbers a post-mortem quotes come from :func:`symptoms` and the study's scores, the same
values ``metrics/spike.json`` holds; the lessons are rules over that evidence (:func:`lessons`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model.data import Tokens
from tasks.data.unigram import unigram_baseline
from tasks.design.curves import trailing_mean
from tasks.pretrain.figures import PANEL, draw
from tasks.runtime.files import staged, write_json
from tasks.runtime.outputs import MANIFEST, POSTMORTEMS, SPIKE_FIGURES, SPIKE_METRICS
from tasks.spike.study import CAUSES, Study
from tasks.spike.summary import summary_metrics, symptoms

TYPE_NAMES = {1: "recoverable", 2: "lingering", 3: "divergent"}
OUTCOME_RANK = {"recovered": 0, "gap": 1, "gave_up": 2}
"""Which outcome a recommendation prefers: back in time, then completed with a gap, then gave up."""
RESTORING = ("skip_batch", "rollback", "rollback_lower_lr", "swap_data")
"""Policies that take the cause away (skip or swap the batches, go back to a clean state): the ones
a lesson recommends automating where ``continue`` did not recover and one of them did."""
SECTIONS = ("Symptoms", "Evidence", "Classification", "Recovery action", "Outcome", "Lessons / followups")
"""The template's sections, in order."""


def best_policy(study: Study, kind: str) -> str:
    """The policy to recommend: the best outcome, then the lowest type, then the cheapest."""
    scores = study.scores[kind]
    return min(scores, key=lambda p: (OUTCOME_RANK[scores[p]["outcome"]], scores[p]["type"], scores[p]["cost_usd"]))


def collapse_flags(study: Study, kind: str) -> list[str]:
    """Seed 000 (repetitive or empty generations) and seed 002 (attention-entropy collapse)."""
    flags = []
    before = study.collapse_before
    for policy, s in study.scores[kind].items():
        after = s.get("collapse") or {}
        if before and after and after["distinct_2"] < 0.5 * before["distinct_2"]:
            flags.append(f"{policy}: distinct-2 fell from {before['distinct_2']:.2f} to {after['distinct_2']:.2f}")
        if after and after["empty_rate"] >= 0.5:
            flags.append(f"{policy}: {after['empty_rate']:.0%} of generations empty")
    stats = study.spike_stats.get(kind, {})
    for key, value in stats.get("at_spike", {}).items():
        pre = stats["pre_spike"].get(key)
        if key.startswith("stats/attn_entropy/") and pre and value < 0.5 * pre:
            block = key.rsplit("/", 1)[1]
            flags.append(f"attention entropy of {block} fell from {pre:.2f} to {value:.2f} nats at the spike")
    return flags


def lessons(study: Study, kind: str) -> list[str]:
    """Follow-ups derived from the evidence by rules (seed 004's playbook)."""
    cfg, scores, replay = study.cfg, study.scores[kind], study.replays[kind]
    out = []
    if cfg.optim.beta2 > 0.95:
        out.append(
            f"Lower Adam β₂ from {cfg.optim.beta2} to 0.95: v then adapts in ~20 steps and damps "
            f"an anomalous gradient (PaLM)."
        )
    if cfg.optim.grad_clip == 0:
        out.append("Turn gradient clipping on (max norm 1.0): the first line of defence.")
    if kind == "data" and replay["spiked"]:
        out.append(
            f"Filter these poison reasons out of the corpus ({', '.join(cfg.spike.data_reasons)}): "
            f"the offending batches alone reproduce the spike."
        )
    keep_going = scores.get("continue")
    fixes = [p for p in RESTORING if p in scores and scores[p]["type"] == 1]
    if keep_going and keep_going["type"] >= 2 and fixes:
        out.append(
            f"Automate {' / '.join(fixes)} for this kind of spike: `continue` was type "
            f"{keep_going['type']} (gap {keep_going['final_gap']:+.1%}), {fixes[0]} closed it."
        )
    gave_up = [p for p, s in scores.items() if s["status"] == "stopped"]
    if gave_up:
        out.append(
            f"{', '.join(gave_up)} gave up at the retry cap: the cause persists across restarts; "
            f"lower the LR for the whole stretch (playbook D) or find the recurring cause."
        )
    late = [s["latency"] for s in scores.values() if s["latency"]]
    if late:
        out.append(
            f"The detector fired up to {max(late)} step(s) after the injection: the first bad update "
            f"had already happened; log per-batch loss to catch the cause, not the effect."
        )
    if study.false_positives:
        out.append(
            f"{len(study.false_positives)} false alarm(s) on the control: raise spike.detect_zscore "
            f"or spike.detect_ratio."
        )
    if collapse_flags(study, kind):
        out.append("Add per-layer attention-entropy alerts: the spike came with a collapse sign (see Classification).")
    lowered = [p for p in ("lower_lr", "rollback_lower_lr") if p in scores and scores[p]["type"] == 1]
    if kind in ("lr", "grad") and lowered:
        out.append(f"Check the LR schedule and scaling around this step; {' / '.join(lowered)} recovered it.")
    return out or ["No follow-up: every policy recovered within the window at no extra cost."]


def _fmt(value: Any, spec: str = ".4f") -> str:
    if value is None:
        return "-"
    return format(value, spec) if isinstance(value, float) else str(value)


def render(study: Study, kind: str, number: int, run_uris: dict[str, str], histogram: str) -> str:
    """One post-mortem in the template's sections (values as in metrics/spike.json)."""
    cfg, injection, scores = study.cfg, study.injections[kind], study.scores[kind]
    s, replay, best = symptoms(study, kind), study.replays[kind], best_policy(study, kind)
    observed = scores[s["observed_policy"]]
    stats = study.spike_stats.get(kind, {})
    blocks = sorted({k.rsplit("/", 1)[1] for k in stats.get("at_spike", {}) if k.startswith("stats/act_l2/")})
    cause = CAUSES[kind].format(reasons=", ".join(cfg.spike.data_reasons), **injection.spec())
    attribution = (
        "data: the offending batches alone reproduce the spike"
        if replay["spiked"]
        else "data and state together: the offending batches alone do not reproduce it"
    )
    c = study.costs
    tokens_per_s = c.tokens_per_step / c.seconds_per_step
    best_score = scores[best]
    lines = [
        f"# Spike #{number} — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"Injected `{kind}` spike at step {injection.start}, tied to the {injection.tied_to} (seed {study.seed}: "
        f"origin run checkpoint at step {study.cfg.spike.origin_step}, branches from step {study.fork_step}, "
        f"window to step {study.end_step}).",
        "",
        "## Symptoms",
        f"- Pre-spike loss: {_fmt(s['pre_spike_loss'])}",
        f"- Peak loss: {_fmt(s['peak_loss'])} (step {s['peak_step']}, "
        f"{_fmt(observed['peak_ratio'], '.2f')}x the control)",
        f"- Recovery loss ({cfg.recovery.recover_steps} steps later): {_fmt(s['recovery_loss'])} "
        f"(step {s['recovery_step']}, smoothed over {cfg.recovery.smooth_steps} steps)",
        f"- Grad norm peak: {_fmt(s['grad_norm_peak'])} (pre-clip, step {s['grad_norm_peak_step']})",
        "",
        "## Evidence",
        f"- mlflow run: {run_uris.get(study.branch_name(kind, s['observed_policy']), '-')} "
        f"(control: {run_uris.get(study.branch_name(None, 'continue'), '-')})",
        f"- Batch index range: {replay['positions'][0]}–{replay['positions'][-1]} "
        f"(stream positions of steps {replay['steps'][0]}–{replay['steps'][-1]})",
        f"- Token histogram for offending batches: ![token histogram]({histogram})",
        "- Per-layer activation L2 at spike:",
        "",
        "  | block | act L2 pre-spike (clean batch) | act L2 at spike (offending batch) "
        "| attn entropy pre-spike | attn entropy at spike |",
        "  |---|---|---|---|---|",
        *[
            f"  | {b} | {_fmt(stats['pre_spike'].get(f'stats/act_l2/{b}'), '.3f')} | "
            f"{_fmt(stats['at_spike'].get(f'stats/act_l2/{b}'), '.3f')} | "
            f"{_fmt(stats['pre_spike'].get(f'stats/attn_entropy/{b}'), '.3f')} | "
            f"{_fmt(stats['at_spike'].get(f'stats/attn_entropy/{b}'), '.3f')} |"
            for b in blocks
        ],
        "",
        f"- Detection: first flagged step {_fmt(observed['detected_at'])} (latency "
        f"{_fmt(observed['latency'])} steps); false alarms on the control: {len(study.false_positives)}",
        f"- Replay (PaLM §5.1): the {replay['batches']} offending batch(es) fed again from step "
        f"{replay['from_step']}: " + (f"spiked (flagged at {replay['flagged']})" if replay["spiked"] else "no spike"),
        "",
        "## Classification",
        f"- Type: {observed['type']} ({TYPE_NAMES[observed['type']]}) — {observed['why']}",
        f"- Root cause: {cause}; replay attribution: {attribution}",
        "- Collapse: "
        + ("; ".join(collapse_flags(study, kind)) or "none seen (distinct-2, empty outputs, attention entropy)"),
        "",
        "## Recovery action",
        f"- Recommended: `{best}` — {_actions(best_score['actions']) or 'no action needed'}",
        "",
        "  | policy | actions |",
        "  |---|---|",
        *[f"  | {p} | {_actions(sc['actions']) or '-'} |" for p, sc in scores.items()],
        "",
        "## Outcome",
        f"- {_outcome(best, best_score, injection.start)}",
        f"- Cost of incident: {best_score['wasted_steps']} steps × {c.tokens_per_step} tokens/step ÷ "
        f"{tokens_per_s:,.0f} tokens/s × ${cfg.spike.gpu_hour_usd:.2f}/hr ÷ 3600 = ${best_score['cost_usd']:.6f}.",
        "",
        "  | policy | type | peak ratio | steps to recover | final gap | val gap | wasted steps | cost $ | status |",
        "  |---|---|---|---|---|---|---|---|---|",
        *[
            f"  | {p} | {sc['type']} | {_fmt(sc['peak_ratio'], '.2f')} | {_fmt(sc['steps_to_recover'])} | "
            f"{_fmt(sc['final_gap'], '+.4f')} | {_fmt(sc['val_gap'], '+.4f')} | {sc['wasted_steps']} | "
            f"{sc['cost_usd']:.6f} | {sc['status']} |"
            for p, sc in scores.items()
        ],
        "",
        "## Lessons / followups",
        *[f"- {line}" for line in lessons(study, kind)],
    ]
    return "\n".join(lines) + "\n"


def _actions(actions: list[dict[str, Any]]) -> str:
    """Actions in order, a run of one action on consecutive steps as one range."""
    runs: list[list[Any]] = []  # [first step, last step, action]
    for a in actions:
        if runs and runs[-1][2] == a["action"] and a["step"] == runs[-1][1] + 1:
            runs[-1][1] = a["step"]
        else:
            runs.append([a["step"], a["step"], a["action"]])
    return "; ".join(
        f"step {first}: {action}" if first == last else f"steps {first}–{last}: {action}"
        for first, last, action in runs
    )


def _outcome(policy: str, s: dict[str, Any], start: int) -> str:
    if s["outcome"] == "recovered":
        return (
            f"With `{policy}` the loss curve resumed the control's trajectory at step "
            f"{start + s['steps_to_recover']} ({s['steps_to_recover']} steps after the injection)."
        )
    return f"No policy brought the loss back within the window; best was `{policy}` ({s['why']})."


def token_histogram(study: Study, kind: str, train_tokens: Tokens, path: Path) -> Path:
    """The 20 commonest tokens of the offending batches: their share there and in training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policy = symptoms(study, kind)["observed_policy"]
    branch = study.branches[kind][policy]
    ids = torch.cat([branch.batches[s][0].flatten() for s in study.replays[kind]["steps"] if s in branch.batches])
    counts = torch.bincount(ids, minlength=study.cfg.tokenizer.vocab_size).double()
    top = torch.argsort(counts, descending=True)[:20]
    reference = np.bincount(np.asarray(train_tokens[:1_000_000], dtype=np.int64), minlength=len(counts))
    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=90)
    x = np.arange(len(top))
    ax.bar(x - 0.2, (counts[top] / counts.sum()).numpy(), 0.4, label="offending batches")
    ax.bar(x + 0.2, reference[top.numpy()] / max(1, reference.sum()), 0.4, label="training split")
    ax.set_xticks(x, [str(int(t)) for t in top], rotation=90, fontsize=7)
    ax.set_xlabel("token id")
    ax.set_ylabel("share of tokens")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"Spike ({kind}): the commonest tokens of steps {study.replays[kind]['steps']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_postmortems(study: Study, train_tokens: Tokens, out_dir: Path, run_uris: dict[str, str]) -> list[Path]:
    """One markdown file (and its token histogram) per injected spike, into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for number, kind in enumerate(study.injections, start=1):
        histogram = token_histogram(study, kind, train_tokens, out_dir / f"spike_{number}_{kind}_tokens.png")
        path = out_dir / f"spike_{number}_{kind}.md"
        path.write_text(render(study, kind, number, run_uris, histogram.name), encoding="utf-8")
        written += [path, histogram]
    return written


def spike_figures(study: Study, out_dir: Path) -> list[Path]:
    """Per injection: the control and every policy's smoothed loss and pre-clip grad norm."""
    smooth = study.cfg.recovery.smooth_steps
    paths = []
    for kind, by_policy in study.branches.items():
        branches = {"control": study.control, **by_policy}
        curves = {
            name: {
                "step": [row["step"] for row in b.rows],
                "loss": list(trailing_mean(np.array([row["loss"] for row in b.rows]), smooth)),
                "grad_norm": [row["grad_norm"] for row in b.rows],
            }
            for name, b in branches.items()
        }
        panels: list[PANEL] = [
            (f"Training loss (trailing mean of {smooth} steps)", [(n, "loss") for n in branches], False),
            ("Gradient norm before clipping", [(n, "grad_norm") for n in branches], True),
        ]
        title = f"{kind} spike injected at step {study.injections[kind].start}: the control and every policy"
        if (path := draw(curves, panels, out_dir / f"{kind}.png", title)) is not None:  # None: no data to draw
            paths.append(path)
    return paths


def publish(
    project: Path,
    studies: Sequence[Study],
    train_tokens: Tokens,
    run_uris: dict[str, str],
    numerics: dict[str, Any],
    wall_s: float | None = None,
) -> dict[str, Any]:
    """The stage's outputs, atomically: metrics/spike.json (the matrix, every seed, ``numerics``:
    the arithmetic that trained them, model/provenance.py, and ``wall_s``: the stage's wall time
    to here), the figures and post-mortems (the first seed's). The plateau gate reads the unigram baseline of the project's tokens at the origins'
    context length, the one the report reads. Returns the metrics."""
    unigram = unigram_baseline(project / MANIFEST, studies[0].cfg.model.seq_len)["unigram_val_loss"]
    metrics = {**summary_metrics(studies, float(unigram)), "provenance": numerics, "wall_s": wall_s}
    with staged(project / SPIKE_METRICS, project / SPIKE_FIGURES, project / POSTMORTEMS) as (json_out, figs, pms):
        spike_figures(studies[0], figs)
        write_postmortems(studies[0], train_tokens, pms, run_uris)
        write_json(json_out, metrics)
    return metrics
