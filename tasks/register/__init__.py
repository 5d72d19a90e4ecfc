"""``spikelab register``: freeze a design into its registration record (tasks/design/registration.py),
after the checks a registration makes and a stage cannot (gates.py: no gate whose value is fixed by
construction; plan.py: the looks each family's budget reaches and the power the design has there).
It reads the stages' arms and the report's sequential rule, so it sits above both (tests/test_layering.py)."""
