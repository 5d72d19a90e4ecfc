# Two commands for a fresh machine: `make repro` (set up, start the servers, run the study) and
# `make test` (set up, run the test suite). `make lint`: ruff and mypy, as CI runs it. The rest are conveniences.
# Every recipe runs with the CLI's umask and every engine's scratch under .spikelab/ (scripts/private-shell).
SHELL := $(CURDIR)/scripts/private-shell
export PATH := $(CURDIR)/.venv/bin:$(PATH)

.PHONY: setup repro test lint services services-down

.venv/.installed: pyproject.toml constraints.txt scripts/setup.sh
	scripts/setup.sh
	touch $@

setup: .venv/.installed

repro: setup services
	dvc repro

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
