# Three commands for a fresh machine: `make demo` (set up, start the servers, run every stage at the
# smoke profile's tiny sizes in a copy under .spikelab/demo/: about 5 minutes, the checkout's outputs
# untouched), `make repro` (set up, start the servers, run the study here) and `make test` (set up,
# run the test suite). `make lint`: ruff and mypy, as CI runs it. The rest are conveniences.
# Every recipe runs with the CLI's umask and every engine's scratch under .spikelab/ (scripts/private-shell).
SHELL := $(CURDIR)/scripts/private-shell
export PATH := $(CURDIR)/.venv/bin:$(PATH)

.PHONY: setup demo repro test lint services services-down

.venv/.installed: pyproject.toml constraints.txt scripts/setup.sh
	scripts/setup.sh
	touch $@

setup: .venv/.installed

demo: setup
	scripts/demo.sh

repro: setup services
	python -m flows.pipeline  # dvc repro under one Prefect flow run; publishes the deployments

test: setup
	python -m pytest -q

lint: setup
	ruff check .
	ruff format --check .
	mypy

services: setup
	spikelab services up

services-down:
	spikelab services down
