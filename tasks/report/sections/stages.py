"""The stages' detail, after the findings: the data sensitivity (:func:`sensitivity_section`), the
arms per family (:func:`arms_section`), the search (:func:`search_section`), the spike study
(:func:`spike_section`) and pretraining (:func:`pretrain_section`), each from its stage's metrics."""

from __future__ import annotations

from pathlib import Path
from statistics import fmean
from typing import Any

from tasks.config import Config
from tasks.design.preregistration import design
from tasks.report.findings import SPIKE_CONSTRUCTION
from tasks.report.method import halves_for, number
from tasks.report.recovery import latencies, latency_text, margin, recovery, recovery_label, scored_gap, scored_gaps
from tasks.report.sections.runs import ARMS_PAGE
from tasks.report.sections.section import REPORTS, SIGNED, UNITS, Figures, Section, interval, table
from tasks.report.sections.words import LABELS
from tasks.spike.config import OUTCOMES

SEARCH = "μ-transfer (search stage)"

FAMILY_COLUMNS = (
    ("capped_loss", "val loss (capped)", "{:.3f}"),
    ("spikes_per_1k", "spikes / 1k steps", "{:.2f}"),
    ("update_rms_max", "max update RMS", "{:.2f}"),
    ("attn_logit_max", "max attn logit", "{:.3g}"),
    ("log_z_max", "max log Z", "{:.2f}"),
    ("grad_underflow_share", "grads < 2⁻²⁴", "{:.2%}"),
)
"""The per-variant columns of the arms' tables: figure, header, format of the mean."""


def arms_section(cfg: Config, ablate: dict[str, Any]) -> Section:
    """The arms' counts by status and size, then per variant of each family the mean over seeds of
    each figure (:data:`FAMILY_COLUMNS`) with its 95 % t-interval."""
    counts = ablate["counts"]
    lines = [
        f"{len(ablate['arms'])} arms ({counts['completed']} completed, {counts['diverged']} diverged, "
        f"{counts['stopped']} stopped, "
        f"{counts['failed']} failed after retries{': ' + ', '.join(ablate['failed']) if ablate['failed'] else ''}), "
        f"each trained from scratch at width {cfg.ablation.d_model}, {cfg.ablation.seq_len}-token context, "
        f"discovery seeds {cfg.ablation.seeds}, confirmation seeds {cfg.ablation.confirm_seeds}. Every arm with "
        f"its status, MLflow run and the command that reproduces it: [{ARMS_PAGE.as_posix()}]"
        f"({ARMS_PAGE.as_posix()}). Per variant: the mean over seeds and its 95 % t-interval.",
        "",
    ]
    header = ["family", "variant", "seeds", "status", *(h for _, h, _ in FAMILY_COLUMNS)]
    rows = []
    for name, entry in ablate["variants"].items():
        statuses = ", ".join(f"{entry['status'].count(s)} {s}" for s in sorted(set(entry["status"])))
        family, variant = name.split("/", 1)
        rows.append(
            [family, variant, str(len(entry["seeds"])), statuses]
            + [_mean_interval(entry["figures"].get(k, {}), fmt) for k, _, fmt in FAMILY_COLUMNS]
        )
    return Section("The arms, family by family", [*lines, *table(header, rows), ""])


def _mean_interval(d: dict[str, Any], fmt: str) -> str:
    if d.get("mean") is None:
        return "-"
    text = fmt.format(d["mean"])
    if d.get("ci95"):
        lo, hi = d["ci95"]
        text += f" [{fmt.format(lo)}, {fmt.format(hi)}]"
    return text + (f" ({d['missing']} not finite)" if d.get("missing") else "")


def search_section(search: dict[str, Any] | None) -> Section:
    """The search stage's slope of the optimal LR on width per parametrization, the optimum at each
    width, the transfer and which trials the pruner stopped."""
    if not search:
        return Section(SEARCH, ["The search stage has not run.", ""])
    names = [p for p in ("sp", "mup") if p in search]
    slopes = [[p, f"{search[p]['slope']:+.3f}", f"{search[p]['slope_std']:.3f}"] for p in names]
    optima = [
        [p, w, f"{search[p]['widths'][w]['log2_lr_opt']:.2f}", f"{search[p]['widths'][w]['loss_opt']:.3f}"]
        for p in names
        for w in sorted(search[p]["widths"], key=int)
    ]
    lines = [
        "The slope of the optimal log₂ LR (η*) on log₂ width, over the seeds, and the optimum at each width "
        "(the study's trials are in optuna-dashboard and, as child runs of the search stage's run, in MLflow):",
        "",
        *table(["parametrization", "slope", "SD over seeds"], slopes),
        "",
        *table(["parametrization", "width", "log₂ η*", "loss at η* (nats)"], optima),
    ]
    transfer = search.get("transfer", {})
    if transfer:
        lines += [
            "",
            f"Transferred LR {transfer.get('lr', float('nan')):.4g}; loss gap to a direct sweep at the "
            f"target width {_transfer_gap(transfer)}; compute ratio {transfer.get('compute_ratio', float('nan')):.2f}.",
        ]
    return Section(SEARCH, [*lines, *_search_pruning_lines(search.get("pruning")), ""])


def _transfer_gap(transfer: dict[str, Any]) -> str:
    """The transferred LR's loss gap to the direct sweep's best, or why there is none: every seed's
    direct optimum censored (a bound, not a point: tasks/search/fit.py)."""
    if (gap := transfer.get("loss_gap")) is not None:
        return f"{gap:+.4f} nats"
    censored = transfer.get("direct_censored") or {}
    why = "; ".join(f"seed {seed}: {reason}" for seed, reason in sorted(censored.items())) or "no seed's direct optimum"
    return f"not measured (the direct sweep's optimum is censored: {why})"


def _search_pruning_lines(pruning: dict[str, Any] | None) -> list[str]:
    """Which trials the search's pruner stopped, at which step: a line, then a row per parametrization
    and width (per seed, log₂ LR @ step). None for a search that recorded no pruning."""
    if not pruning:
        return []
    rule = pruning["rule"]
    if rule.get("median"):
        warmup = rule["n_warmup_steps"]
        how = (
            f"Optuna's MedianPruner within each parametrization × width × seed, its LRs in ascending order, the "
            f"first {rule['n_startup_trials']} always to the end, a trial judged at each report"
            + (f" from step {warmup}" if warmup else "")
            + f" but its last; and the loss bound {rule['prune_above']:.3g} nats"
        )
    else:
        how = f"the loss bound {rule['prune_above']:.3g} nats only (search.prune_median: false)"
    lines = [
        "",
        f"Pruning ({how}): **{pruning['pruned']} of {pruning['trials']} trials stopped**, "
        f"{pruning['steps_saved']:,} of {pruning['steps']:,} steps saved ({pruning['steps_saved_share']:.1%}). "
        "The optima and slopes above are fitted from the trials that ran to the end; an optimum at the grid's "
        "end or next to a stopped LR is censored, a bound (version 4).",
    ]
    rows: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for g in pruning["groups"]:
        rows.setdefault((g["kind"], g["parametrization"], g["width"]), []).append(g)
    stopped_rows = []
    for (kind, p, w), groups in rows.items():
        stopped = sum(len(g["pruned"]) for g in groups)
        if kind != "sweep" and not stopped:
            continue
        where = "; ".join(
            f"seed {g['seed']}: "
            + ", ".join(
                f"{t['log2_lr']:.2f}@{t['step']}" + ("" if t["by"] == "median" else f" ({t['by']})")
                for t in g["pruned"]
            )
            for g in groups
            if g["pruned"]
        )
        stopped_rows.append(
            [
                p if kind == "sweep" else f"{p} ({kind})",
                str(w),
                f"{stopped} / {sum(g['trials'] for g in groups)}",
                f"{sum(g['steps_saved'] for g in groups):,}",
                where or "none",
            ]
        )
    if stopped_rows:
        lines += [
            "",
            *table(
                ["parametrization", "width", "stopped / trials", "steps saved", "stopped at (log₂ LR @ step)"],
                stopped_rows,
            ),
        ]
    return lines


def spike_section(project: Path, spike: dict[str, Any] | None) -> Section:
    """The spike study: per cause and policy how the branches ended and their mean scored gap, the
    detector's rate per cause, and the post-mortems under reports/postmortems."""
    if not spike or "matrix" not in spike:
        return Section("Spike study", ["The spike stage has not run.", ""])
    matrix, policies = spike["matrix"], spike["policies"]
    counts = [
        [f"{cause} ({_tied_to(spike, cause)})", *(_spike_counts(matrix[cause].get(p, {})) for p in policies)]
        for cause in spike["causes"]
    ]
    gaps = [[cause, *(_spike_gap(matrix[cause].get(p, {})) for p in policies)] for cause in spike["causes"]]
    seeds = ", ".join(str(s) for s in spike["discovery_seeds"])
    confirm = ", ".join(str(s) for s in spike["confirm_seeds"]) or "none"
    lines = [
        f"False alarms on the clean controls: {spike.get('false_positives')}. Per cause and policy, over the seeds: "
        "how many branches recovered (back within ε in time) / ended with a gap (back late, settled above, or "
        "diverged) / gave up (the retry cap):",
        "",
        *table(["cause", *policies], counts),
        "",
        "The mean scored gap to the seed's control (version 3: a branch that gave up is scored at the loss it "
        "gave up at, for every step it did not run; version 2's studies have only the final gap of the branches "
        "that did not give up):",
        "",
        *table(["scored gap", *policies], gaps),
        "",
        f"Each cell against its origins' clean controls (version 4): equivalent within ±{margin():.0%} (TOST at α, "
        "each half's estimate inside), worse or better than clean by more than that, or not shown; the mean gap "
        "and its 95 % interval. Unadjusted here; the finding Holm-adjusts its claims. A construction check (c) is "
        "decided by how the branch is built, never evidence:",
        "",
        *table(["vs clean", *policies], _recovery_rows(spike)),
        *_detection_lines(spike),
    ]
    postmortems = sorted((project / REPORTS / "postmortems").glob("*.md"))
    title = f"Spike study (independent origin runs: discovery seeds {seeds}; confirmation seeds {confirm})"
    return Section(
        title,
        [
            *lines,
            "",
            f"Post-mortems (seed {spike['postmortem_seed']}): "
            + (", ".join(f"[{p.stem}](postmortems/{p.name})" for p in postmortems) or "none"),
            "",
        ],
    )


def _recovery_rows(spike: dict[str, Any]) -> list[list[str]]:
    """Per cause, each policy's recovery verdict against the clean control with its mean gap and
    interval (tasks/report/recovery.py), the construction checks marked (c)."""
    halves = halves_for(spike.get("discovery_seeds", []), spike.get("confirm_seeds", []))
    rows = []
    for cause in spike["causes"]:
        row = [cause]
        for policy in spike["policies"]:
            claim = recovery(f"{cause}×{policy}", scored_gaps(spike["matrix"], cause, policy), halves, margin())
            ci = f" [{claim.ci95[0]:+.1%}, {claim.ci95[1]:+.1%}]" if claim.ci95 else ""
            mark = " (c)" if (cause, policy) in SPIKE_CONSTRUCTION else ""
            gap = "-" if claim.estimate is None else f"{claim.estimate:+.1%}"
            row.append(f"{recovery_label(claim).split(' (')[0]}{mark}: {gap}{ci}")
        rows.append(row)
    return rows


def _detection_lines(spike: dict[str, Any]) -> list[str]:
    """The detector's rate per cause and the origins the plateau gate left out (version 3)."""
    detection = spike.get("detection")
    if not detection:
        return []
    rates = "; ".join(
        f"{cause} {d['detected']} of {d['injected']}"
        + (f" (missed at seeds {', '.join(map(str, d['missed_seeds']))})" if d["missed_seeds"] else "")
        for cause, d in detection.items()
    )
    excluded = (spike.get("plateau") or {}).get("excluded") or []
    left_out = f" Origins left out on the plateau: {', '.join(map(str, excluded))}." if excluded else ""
    latency = "; ".join(f"{cause} {latency_text(latencies(spike, cause))}" for cause in detection)
    return [
        "",
        f"Spikes the detector caught, per cause: {rates}.{left_out}",
        "",
        f"The detector's latency, injection's first step to its first flag on continue, per cause: {latency}.",
    ]


CAUSE_OF_TIE = {"stream": "data-tied", "once": "state-tied", "step": "step-tied"}
"""How the report names a cause by what its injection is tied to (model/spike/injections.py)."""


def _tied_to(spike: dict[str, Any], cause: str) -> str:
    entry = next(iter(spike["seeds"].values()))
    return CAUSE_OF_TIE[entry[cause]["injection"]["tied_to"]]


def _spike_counts(by_seed: dict[str, dict[str, Any]]) -> str:
    """recovered / gap / gave up over the seeds."""
    cells = list(by_seed.values())
    return "/".join(str(sum(c["outcome"] == o for c in cells)) for o in OUTCOMES)


def _spike_gap(by_seed: dict[str, dict[str, Any]]) -> str:
    """The mean scored gap (a give-up scored at the loss it gave up at; version 2: the final gap of
    the branches that have one)."""
    gaps = [g for c in by_seed.values() if (g := scored_gap(c)) is not None]
    return f"{fmean(gaps):+.1%}" if gaps else "-"


def pretrain_section(pretrain: dict[str, Any] | None) -> Section | None:
    """The pretraining stage's status, losses and telemetry, and its figures; None when it has not run."""
    if not pretrain:
        return None
    tel = pretrain.get("telemetry", {})
    lines: list[str | Figures] = [
        f"Status {pretrain['status']}, {pretrain['steps']} steps, {pretrain['precision']}; final train loss "
        f"{pretrain['final_loss']:.4f}, validation loss {pretrain['val_loss']:.4f}; grad norm "
        f"{tel.get('grad_norm', float('nan')):.3g}, max attention logit {tel.get('attn_logit_max', float('nan')):.3g}.",
        "",
        Figures(("pretrain/*.png",)),
        "",
    ]
    return Section("Pretraining", lines)


def sensitivity_section(sensitivity: dict[str, Any] | None) -> Section | None:
    """Data sensitivity (metrics/sensitivity.json, the sensitivity stage's): each built-in finding's
    estimate at the discovery seeds with a registered share of the training documents dropped, beside
    its estimate on the full data at the same seeds, and their per-seed difference with its interval.
    None when the stage has not run."""
    if not sensitivity:
        return None
    p, found = sensitivity["perturbation"], sensitivity["findings"]
    rows, notes = [], []
    for key in sorted(found, key=lambda k: [*design()["findings"], k].index(k)):  # the pre-registration's order
        entry, name = found[key], LABELS.get(key, key)
        if not entry["claims"]:
            notes.append(f"- {name}: not in this grid ({entry.get('missing')}).")
        for i, c in enumerate(entry["claims"]):
            unit, d = UNITS.get(c.get("unit") or "", ""), c["difference"]
            rows.append(
                [
                    f"[{name}](#{key})" if i == 0 else "",
                    c["statement"],
                    f"{number(c['main']['estimate'], SIGNED)}{unit}",
                    f"{number(c['perturbed']['estimate'], SIGNED)}{unit}",
                    f"{number(d['estimate'], SIGNED)} [{interval(d['ci95'])}] (n {d['n']})",
                ]
            )
        failed = entry.get("precondition_failed") or {}
        if bool(failed.get("main")) != bool(failed.get("perturbed")):
            side, why = ("full data", failed["main"]) if failed.get("main") else ("perturbed data", failed["perturbed"])
            notes.append(f"- {name}: its precondition failed on the {side} only: {why}.")
    lines = [
        f"Each finding's estimate at the discovery seeds ({', '.join(str(s) for s in sensitivity['seeds'])}) "
        f"trained again with {p['drop_share']:.0%} of the training documents dropped ({p['dropped']:,} of "
        f"{p['documents']:,}, drawn with seed {p['seed']}; validation unchanged), beside its estimate on the full "
        "data at the same seeds. The difference is per seed, perturbed − full, with its 95 % t-interval (none "
        "below 2 seeds). A registered perturbation, read by no verdict: it shows how far an estimate moves "
        "when the data does.",
        "",
        *table(["finding", "claim", "full data", "perturbed", "difference [95 % interval]"], rows),
        "",
        *notes,
        *([""] if notes else []),
    ]
    return Section("Data sensitivity", lines)
