"""Stage spike: injections from a pretrain milestone against a clean control, the recovery
policies, replay and the seed-004 post-mortems (flows/spike.py runs it)."""
