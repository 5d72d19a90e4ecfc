# Three commands for a fresh machine: `make demo` (set up, start the servers, run every stage at the
# smoke profile's tiny sizes in a copy under .spikelab/demo/, about 3 minutes after setup; this
# checkout's outputs untouched), `make repro` (set up, start the servers, run the study here) and `make test` (set up,
# run the test suite). `make lint`: ruff and mypy, as CI runs it. The rest are conveniences;
# `make help` lists them all, each from its `## ` comment.
# Every recipe runs with the CLI's umask and every engine's scratch under .spikelab/ (scripts/private-shell).
SHELL := $(CURDIR)/scripts/private-shell
export PATH := $(CURDIR)/.venv/bin:$(PATH)

.PHONY: help setup demo repro test lint services services-down

.venv/.installed: pyproject.toml constraints.txt scripts/setup.sh
	scripts/setup.sh
	touch $@

help: ## list these targets, one line each
	@sed -n 's/^\([a-z][a-z-]*\):.*## \(.*\)/  \1\t\2/p' $(firstword $(MAKEFILE_LIST)) | expand -t 18

setup: .venv/.installed ## create .venv with the pinned dependencies (first run: about 3 min on 2 cores)
ifeq ($(MAKECMDGOALS),setup)
	@echo "setup: next: make demo (every stage at tiny sizes in a copy, and one claim decided at demo size: about 3 min after setup on 2 cores)"
endif

demo: setup ## set up, start the servers, run every stage at tiny sizes in .spikelab/demo/
	scripts/demo.sh

# `python -m flows.repro` publishes the deployments, then runs `dvc repro` under one Prefect flow
# run (each stage its child). A stop (Ctrl-C, SIGTERM) leaves what git tracks as it was: the stopped
# stage puts its own outputs back (KeptOutputs); the recipe puts back dvc.lock and the tracked outputs of stages that finished
# before the stop (flows/stages.py: tracked_by_repro) from a snapshot of the working tree taken first
# (`git stash create`: a commit object, nothing in the tree moves), so those stages run again next
# time. A file edited meanwhile that is not the pipeline's is never touched. make itself ends by
# the signal, as any command stopped so (130 after Ctrl-C, 143 after SIGTERM).
repro: setup services ## set up, start the servers, run the whole study here (a stop changes nothing git tracks)
	@before=$$(git stash create 2>/dev/null || true); before=$${before:-$$(git rev-parse -q --verify HEAD || true)}; \
	trap stopped=1 INT TERM; python -m flows.repro; done=$$?; \
	if [ -n "$${stopped:-}" ] && [ -n "$$before" ]; then \
	  git diff -z --relative --name-only "$$before" -- \
	      $$(python -c 'from flows.stages import tracked_by_repro as t; print(*t())') \
	    | xargs -0r git restore --source="$$before" --worktree -- \
	    && echo "make repro: stopped; dvc.lock and every output git tracks are as they were before it"; \
	fi; \
	exit $$done

test: setup ## set up, run the test suite (on two worker processes: tests/conftest.py)
	python -m pytest -q -n 2

lint: setup ## ruff and mypy, as CI runs them
	ruff check .
	ruff format --check .
	mypy

services: setup ## start this checkout's Prefect, MLflow and optuna-dashboard servers
	spikelab services up

services-down: ## stop the servers this checkout started
	spikelab services down
