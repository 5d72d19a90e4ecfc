"""The form `dvc exp run -S` writes studies.yaml in, as docs/ablate.md states it: real DVC, in a
scratch project, the experiment queued (DVC applies -S before it queues, so nothing trains).

DVC has no option to keep a file's formatting; it rewrites the whole file with its own YAML
writer. Comments stay, and a list inside a flow mapping (``optim: {lr: [...]}``) stays a flow
list; a list it sets at a key of a block mapping becomes a block list, and a scalar past 80
columns is re-wrapped (quotes dropped). If DVC's writer changes, this fails and the docs go too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

STUDIES = """\
families:
  qk_rescue:  # a comment DVC keeps
    factors:
      optim: {lr: [0.003, 0.3]}
    seeds: [0, 1]
    justification: "a twentieth of a nat is the least that would make anyone add qk-norm to a model"
"""


def run(cwd: Path, *args: str) -> str:
    env = {**os.environ, "DVC_SITE_CACHE_DIR": str(cwd.parent / "dvc-site"), "DVC_NO_ANALYTICS": "1"}
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_dvc_exp_run_set_keeps_comments_and_flow_mapped_lists_and_rewrites_the_rest(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "studies.yaml").write_text(STUDIES)
    (project / "dvc.yaml").write_text("stages:\n  ablate:\n    cmd: echo\n    params:\n      - studies.yaml:\n")
    git = ("git", "-c", "user.name=t", "-c", "user.email=t@t")
    run(project, *git, "init", "-q")
    run(project, sys.executable, "-m", "dvc", "init", "-q")
    run(project, *git, "add", ".")
    run(project, *git, "commit", "-qm", "a family")
    lr, seeds = "families.qk_rescue.factors.optim.lr=[0.003,0.03,0.3]", "families.qk_rescue.seeds=[0,1,2]"
    run(
        project,
        sys.executable,
        "-m",
        "dvc",
        "exp",
        "run",
        "--queue",
        "-S",
        f"studies.yaml:{lr}",
        "-S",
        f"studies.yaml:{seeds}",
    )
    written = run(project, *git, "show", "refs/exps/celery/stash:studies.yaml")
    assert "  qk_rescue:  # a comment DVC keeps\n" in written
    assert "      optim: {lr: [0.003, 0.03, 0.3]}\n" in written
    assert "    seeds:\n    - 0\n    - 1\n    - 2\n" in written
    assert "    justification: a twentieth of a nat is the least that would make anyone add \n      qk-norm" in written
