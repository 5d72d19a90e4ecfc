"""Stage ablate: the grid of ablation arms, one arm's process, the per-variant statistics and
the family figures (flows/ablate.py runs it)."""
