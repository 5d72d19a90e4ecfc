"""The import graph, drawn from the source (ast): no cycles anywhere in flows/, tasks/, model/,
not even through imports only a type checker follows; every import points down the house's layers
(LAYERS, bottom first), never up and never sideways between two stages of one floor; model/ stays
importable on a bare GPU box.

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


LAYERS: tuple[tuple[str, ...], ...] = (
    ("model",),
    ("tasks",),  # the package's __init__
    ("tasks.runtime",),  # plumbing: paths, servers, tracking, atomic files (its own config section too)
    ("config",),  # tasks/config.py and each stage's config section: the typed params
    ("tasks.design",),  # the pre-registration, declared studies, seed registry, statistics
    ("tasks.params",),
    ("tasks.data",),
    ("tasks.pretrain",),
    ("tasks.search", "tasks.spike", "tasks.ablate"),  # siblings: none imports another
    ("tasks.report",),
    ("tasks.register",),  # spikelab register: reads the stages' arms and the report's sequential rule
    ("tasks.sensitivity",),
    ("tasks.gpu_study",),
    ("flows",),
)
"""The house, bottom floor first: a module imports only from its own room or a lower floor. What two
stages of one floor share lives below both (tasks/design/curves.py for spike and ablate)."""


def room(module: str) -> str:
    """The room a module lives in: its package under tasks/ (stages' config sections apart), else its
    top package."""
    parts = module.split(".")
    if module == "tasks.config" or (len(parts) == 3 and parts[::2] == ["tasks", "config"] and parts[1] != "runtime"):
        return "config"
    if parts[0] == "tasks" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


FLOOR = {name: floor for floor, rooms in enumerate(LAYERS) for name in rooms}


def floor(module: str) -> int:
    """Its room's floor; a room on no floor counts as the top (test_every_room_of_the_tree_has_a_floor
    names it)."""
    return FLOOR.get(room(module), len(LAYERS))


def imports_against_the_order(graph: dict[str, set[str]]) -> list[str]:
    """Each import that goes up a floor or sideways into another room of the same floor."""
    return sorted(
        f"{name} -> {target} ({room(name)} imports {room(target)})"
        for name, targets in graph.items()
        for target in targets
        if room(target) != room(name) and floor(target) >= floor(name)
    )


def test_every_room_of_the_tree_has_a_floor():
    assert {room(name) for name in source_files()} == set(FLOOR), "add the new package to LAYERS"


def test_every_import_points_down_the_house():
    assert imports_against_the_order(import_graph()) == []


@pytest.mark.parametrize(
    "importer, imported",
    [
        ("tasks/ablate/declared.py", "from tasks.report.design import design"),  # a stage reads the report
        ("tasks/ablate/figures.py", "from tasks.spike.curves import trailing_mean"),  # sideways on one floor
        ("model/gpt.py", "from tasks.config import Config"),  # model/ reads the study
        ("tasks/runtime/files.py", "from tasks.data import sources"),  # plumbing reads a stage
        ("tasks/design/studies.py", "from tasks.data.sources import read"),  # the design reads a stage
    ],
)
def test_an_upward_or_sideways_import_is_found(tmp_path, importer, imported):
    modules = {
        importer,
        "tasks/report/design.py",
        "tasks/spike/curves.py",
        "tasks/config.py",
        "tasks/data/sources.py",
        "tasks/runtime/paths.py",
        "model/gpt.py",
    }
    for path in modules:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(imported + "\n" if path == importer else "")
    (tmp_path / "flows").mkdir()
    found = imports_against_the_order(import_graph(tmp_path))
    assert len(found) == 1 and found[0].startswith(module_name(tmp_path / importer, tmp_path)), found


def test_an_import_within_one_room_or_down_a_floor_is_allowed(tmp_path):
    for path, text in {
        "tasks/ablate/figures.py": "from tasks.ablate.grid import arms\nfrom tasks.design.curves import f\n",
        "tasks/ablate/grid.py": "from tasks.ablate.config import AblationConfig\nfrom model.gpt import GPT\n",
        "tasks/ablate/config.py": "from model.gpt import GPT\n",
        "tasks/design/curves.py": "from tasks.config import Config\n",
        "tasks/config.py": "from tasks.ablate.config import AblationConfig\n",
        "model/gpt.py": "",
    }.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    (tmp_path / "flows").mkdir()
    assert imports_against_the_order(import_graph(tmp_path)) == []


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
