"""Stage spike: per seed an origin run, then injections of three causes against a clean control,
the recovery policies, replay and the seed-004 post-mortems (flows/spike.py runs it)."""
