"""Help everywhere: every command a user types (``spikelab`` and its subcommands, each ``spikelab
check`` script, ``python -m flows.gpu_study`` and its subcommands) says what it does, what each
option is and an example, under the name the user types, speaking of the project rather than its
issue tracker; and ``make help`` lists every target of the Makefile."""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
from collections.abc import Iterator

import pytest

from flows import gpu_study
from flows.__main__ import parser as spikelab_parser
from flows.checks import CHECKS
from tests.smoke_study import REPO

README = REPO / "README.md"

ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)


def commands(p: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``p`` and every subcommand's parser below it."""
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from commands(child)


def parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for p in commands(spikelab_parser()):
        yield p.prog, p
    for name, (script, _) in CHECKS.items():
        module = importlib.import_module(f"checks.{script.removesuffix('.py')}")
        for p in commands(module.parser()):
            assert p.prog.startswith(f"spikelab check {name}"), p.prog
            yield p.prog, p
    for p in commands(gpu_study.parser()):
        assert p.prog.startswith("python -m flows.gpu_study"), p.prog
        yield p.prog, p


@pytest.mark.parametrize("prog,p", list(parsers()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_command_has_a_description_help_on_each_option_and_an_example(prog, p):
    assert p.description and p.description.strip(), prog
    assert p.epilog and "example" in p.epilog and prog.split()[0] in p.epilog, prog
    bare = [a.dest for a in p._actions if not a.help and not isinstance(a, argparse._SubParsersAction)]
    assert not bare, f"{prog}: options without help: {bare}"
    assert not ISSUE.search(p.format_help()), prog
    assert ".py" not in prog, prog


def test_an_issue_number_in_help_text_is_caught():
    assert ISSUE.search("the cross-machine check of issue 28") and not ISSUE.search("an issue with the data")


def test_make_help_lists_every_target_of_the_makefile_with_a_line_each():
    makefile = (REPO / "Makefile").read_text()
    targets = re.findall(r"^([a-z][a-z-]*):", makefile, re.MULTILINE)
    shown = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    lines = {line.split()[0]: line for line in shown.stdout.splitlines() if line.strip()}
    for target in targets:
        assert target in lines and len(lines[target].split()) > 1, (target, shown.stdout)


def test_the_setup_time_is_one_figure_in_the_readme_the_setup_script_and_make_help():
    (stated,) = re.findall(r"installs the pinned\ndependencies \((about \d+ min on 2 cores)\)", README.read_text())
    assert f'SETUP_TIME="{stated} (' in (REPO / "scripts/setup.sh").read_text()
    assert f"(first run: {stated})" in (REPO / "Makefile").read_text()


def test_only_make_setup_and_setup_run_by_hand_point_to_make_demo_never_make_repro():
    def planned(*goals: str) -> str:  # -n: what make would run, nothing run
        return subprocess.run(["make", "-n", *goals], cwd=REPO, capture_output=True, text=True, timeout=60).stdout

    assert "next: make demo" in planned("setup")
    assert "make demo" not in planned("-o", "services", "repro")
    script = (REPO / "scripts/setup.sh").read_text().splitlines()
    said = [line for line in script if "make demo" in line and not line.lstrip().startswith("#")]
    assert len(said) == 1 and said[0].startswith('[ -n "${MAKELEVEL:-}" ] || say "next: make demo'), said
