"""The import graph, drawn from the source (ast): no cycles anywhere in flows/, tasks/, model/,
not even through imports only a type checker follows; imports point down the layers (flows ->
tasks -> model, never back); model/ stays importable on a bare GPU box; tasks/runtime/ builds on
no stage; a stage's config section builds on model/ only.

Imports under ``if TYPE_CHECKING:`` are for type checkers and never run: the layer rules leave them
out, the cycle rule counts them (a typing-only circle still ties two modules into one)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "tasks", "model")
ORCHESTRATION = ("prefect", "mlflow", "optuna", "dvc")


def module_name(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files(root: Path = REPO) -> dict[str, Path]:
    return {module_name(p, root): p for package in PACKAGES for p in sorted((root / package).rglob("*.py"))}


def runtime_imports(path: Path, typing: bool = False) -> list[str]:
    """Absolute module names ``path`` imports, at top level or inside functions; those under
    ``if TYPE_CHECKING:`` only with ``typing``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    skipped = (
        set()
        if typing
        else {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body
            for n in ast.walk(stmt)
        }
    )
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def import_graph(root: Path = REPO, typing: bool = False) -> dict[str, set[str]]:
    """Project module -> the project modules it imports (``from a import b`` counts ``a.b`` when
    that is a module, else ``a``); with ``typing``, TYPE_CHECKING imports too."""
    files = source_files(root)
    return {
        name: {target for target in runtime_imports(path, typing) if target in files and target != name}
        for name, path in files.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_project_has_no_import_cycle_not_even_through_type_checking_imports():
    graph = import_graph(typing=True)
    assert {"flows.stages", "tasks.config", "model.train", "model.spike.branch", "tasks.search.queue"} <= graph.keys()
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model/a.py").write_text("from model.b import f\n")
    (tmp_path / "model/b.py").write_text("def f():\n    from model import c\n")
    (tmp_path / "model/c.py").write_text("import model.a\n")
    (tmp_path / "model/d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import model.a\n")
    for package in ("flows", "tasks"):
        (tmp_path / package).mkdir()
    graph = import_graph(tmp_path)
    assert find_cycle(graph) == ["model.a", "model.b", "model.c", "model.a"]
    assert graph["model.d"] == set()


def test_the_cycle_check_finds_a_circle_closed_only_by_a_type_checking_import(tmp_path):
    for package in ("model", "tasks", "flows"):
        (tmp_path / package).mkdir()
    (tmp_path / "model/loop.py").write_text("from model.hooks import Hook\n")
    (tmp_path / "model/hooks.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from model.loop import Loop\n"
    )
    assert find_cycle(import_graph(tmp_path)) is None  # what runs has no cycle
    assert find_cycle(import_graph(tmp_path, typing=True)) == ["model.hooks", "model.loop", "model.hooks"]


@pytest.mark.parametrize("lower, upper", [("model", "tasks"), ("model", "flows"), ("tasks", "flows")])
def test_imports_point_down_the_layers(lower, upper):
    upward = {
        name: sorted(t for t in targets if t.split(".")[0] == upper)
        for name, targets in import_graph().items()
        if name.split(".")[0] == lower
    }
    assert not {k: v for k, v in upward.items() if v}


def test_runtime_builds_on_no_stage_and_no_study_config():
    graph = import_graph()
    bad = {
        name: sorted(t for t in targets if t.startswith("tasks.") and not t.startswith("tasks.runtime"))
        for name, targets in graph.items()
        if name.startswith("tasks.runtime")
    }
    assert not {k: v for k, v in bad.items() if v}


def test_each_stage_config_section_builds_on_model_only():
    sections = [p for p in (REPO / "tasks").glob("*/config.py")]
    assert len(sections) >= 5
    for path in sections:
        project = [t for t in runtime_imports(path) if t.split(".")[0] in PACKAGES]
        assert all(t.startswith("model.") for t in project), (path, project)


MODEL_FILES = sorted((REPO / "model").rglob("*.py"))


@pytest.mark.parametrize("path", MODEL_FILES, ids=lambda p: str(p.relative_to(REPO / "model")))
def test_model_modules_import_no_orchestration_and_no_study_code(path):
    bad = [n for n in runtime_imports(path) if n.split(".")[0] in (*ORCHESTRATION, "tasks", "flows")]
    assert not bad, f"{path.name} imports {bad}"


def test_importing_every_model_module_loads_no_orchestration_package():
    modules = [module_name(p) for p in MODEL_FILES]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        f"bad = sorted(n for n in sys.modules if n.split('.')[0] in {(*ORCHESTRATION, 'tasks', 'flows')!r})\n"
        "assert not bad, bad\n"
        f"assert all(m in sys.modules for m in {modules!r})\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
