"""Stage search: the μP / SP learning-rate search on Optuna, the per-seed optimum fits and the
transfer check, and its figures (flows/search.py runs it)."""
