"""Stage pretrain: the target-width run with scheduled checkpoints and milestones, tracked in
MLflow, and its figures (flows/pretrain.py runs it)."""
