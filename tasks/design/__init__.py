"""The study's design, in a room of its own below every stage that reads it.

What a study promises before it trains: the pre-registration and its loader (preregistration.yaml,
preregistration.py), the declared families (families.py) and their parser (studies.py, for
studies.yaml), the seed registry (seed_registry.py, seed_registry.yaml), the statistics the findings
are tested with (stats.py) and the smoothing the recovery scores read (curves.py). The stages, the report and the gpu study import
it downward; it imports only model/, tasks/runtime/ and the config sections
(tests/test_layering.py)."""
