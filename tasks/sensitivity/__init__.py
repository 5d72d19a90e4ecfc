"""The sensitivity stage: each finding's estimate under a registered data perturbation."""
