"""Train one slice of the gpu study on the machine it runs on: the slice's fused groups,
``--workers`` at once as separate processes sharing the GPU, a group of several arms as
``python -m tasks.ablate.fused`` trains it (one model K times wider, model/fused.py), an arm alone
as ``python -m tasks.ablate.arm``; either writes each arm's result.json alike. Each result is
appended to one gzipped JSON-lines file as its group finishes, so a window that closes early keeps
every group it finished. Imports the standard library only (the arms import torch, numpy and
pyyaml): it runs on a bare GPU box.

    python -m tasks.gpu_study.window gpu_study/slices/01.json --out $OUT/01.jsonl.gz --workers 8 --window-s 480

The file's first line is the window's header (plan, slice, GPU, driver, torch, host), then one line
per arm (its result.json, its group's wall time and size, the arms sharing the GPU when it
started), and a last line with the window's totals. No group starts that its slice's estimate says
cannot finish before ``--window-s``; a group still running then is stopped and its arms recorded
as cut (their partial work is lost: a window is for finished arms).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

ARM = ["-m", "tasks.ablate.arm"]
GROUP = ["-m", "tasks.ablate.fused"]
"""A fused group's command: its arms as one model K times wider (model/fused.py), each arm's
result.json in its own --out, as ARM writes it."""
MARGIN = 1.3
"""A group is not started unless the window has this times its estimate left (tasks/gpu_study/plan.py)."""
GRACE_S = 5.0
"""How long a group the window cuts has to exit after SIGTERM before it is killed."""


def machine() -> dict[str, Any]:
    """The GPU (name, driver, memory) from nvidia-smi, torch and CUDA from torch, the host's CPU."""
    probe = (
        "import json, torch; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
        "'gpus': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))"
    )
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    record: dict[str, Any] = json.loads(found.stdout) if found.returncode == 0 else {"torch": None}
    smi = shutil.which("nvidia-smi")
    if smi:
        query = "--query-gpu=name,driver_version,memory.total,compute_cap"
        out = subprocess.run([smi, query, "--format=csv,noheader"], capture_output=True, text=True).stdout
        record["nvidia_smi"] = [line.strip() for line in out.splitlines() if line.strip()]
    record["host"] = {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()}
    return record


class Window:
    """The window's clock, its sink, and the groups running in it."""

    def __init__(self, sink: BinaryIO, seconds: float) -> None:
        self.started = time.monotonic()
        self.seconds = seconds
        self.sink = sink
        self.lock = threading.Lock()
        self.running: dict[str, tuple[subprocess.Popen, int]] = {}  # by first arm: the process, its arms
        self.measured: dict[str, float] = {}  # per family, the slowest finished arm's wall seconds
        self.finished = 0
        self.not_started = 0
        self.closed = False

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)

    def arms_training(self) -> int:
        return sum(arms for _, arms in self.running.values())

    def write(self, record: dict[str, Any]) -> None:
        with self.lock:
            self.sink.write(gzip.compress(json.dumps(record, allow_nan=False).encode() + b"\n"))
            self.sink.flush()

    def close(self) -> None:
        """Stop every group still running (the window's time is up)."""
        with self.lock:
            self.closed = True
            running = [process for process, _ in self.running.values()]
        for process in running:
            process.terminate()
        for process in running:
            try:
                process.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()

    def estimate(self, group: list[dict[str, Any]]) -> float | None:
        """The slice's estimate of the group's seconds, else this window's own measure of its
        slowest family (None: a family not measured yet)."""
        if group[0].get("estimate_s") is not None:
            return float(group[0]["estimate_s"])
        with self.lock:
            seen = [self.measured.get(arm["family"]) for arm in group]
        return None if None in seen else max(s for s in seen if s is not None) * MARGIN

    def finish(self, arm: dict[str, Any], record: dict[str, Any]) -> None:
        self.write({"arm": record})
        if record["status"] == "not started":
            with self.lock:
                self.not_started += 1
        if record["status"] in ("completed", "diverged"):
            with self.lock:
                self.finished += 1
                self.measured[arm["family"]] = max(self.measured.get(arm["family"], 0.0), record["wall_s"])


def groups_of(arms: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The slice's fused groups in its order (an arm of a slice made before groups: one of its own)."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for i, arm in enumerate(arms):
        groups.setdefault(arm.get("group", f"alone {i}"), []).append(arm)
    return list(groups.values())


def command(group: list[dict[str, Any]], outs: list[Path], scratch: Path) -> list[str]:
    """The process that trains ``group`` into ``outs``: one arm as ``python -m tasks.ablate.arm``,
    several as one fused group (``python -m tasks.ablate.fused``, their arguments in a file)."""
    arguments = []
    for arm, out in zip(group, outs, strict=True):
        own = list(arm["arguments"])
        own[own.index("--out") + 1] = str(out)
        arguments.append(own)
    if len(group) == 1:
        return [sys.executable, *ARM, *arguments[0]]
    listed = scratch / "group.json"
    listed.write_text(json.dumps(arguments))
    return [sys.executable, *GROUP, str(listed)]


def not_started(arm: dict[str, Any], why: str) -> dict[str, Any]:
    return {"key": arm["key"], "name": arm["name"], "status": "not started", "why": why}


def train_group(group: list[dict[str, Any]], project: Path, window: Window) -> list[dict[str, Any]]:
    """One group (one arm, or several fused) in a fresh process, in a scratch directory: each
    arm's record for the results file."""
    estimate_s = window.estimate(group)
    if window.closed or (estimate_s is not None and window.left() < estimate_s):
        return [not_started(arm, "would not finish in the window") for arm in group]
    with tempfile.TemporaryDirectory(prefix="group-") as scratch:
        outs = [Path(scratch) / f"arm{k}" for k in range(len(group))]
        for out in outs:
            out.mkdir(mode=0o700)
        # The project's code first; a PYTHONPATH already set stays after it (a checkout's worktree).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(project), os.environ.get("PYTHONPATH"))))}
        started = time.monotonic()
        with window.lock:
            if window.closed:
                return [not_started(arm, "window closed") for arm in group]
            sharing = window.arms_training() + len(group)
            process = subprocess.Popen(
                command(group, outs, Path(scratch)),
                cwd=project,
                env=env,
                stderr=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                text=True,
            )
            window.running[group[0]["key"]] = (process, len(group))
        _, stderr = process.communicate()
        with window.lock:
            window.running.pop(group[0]["key"], None)
        wall_s = round(time.monotonic() - started, 2)
        shared = {"wall_s": wall_s, "sharing": sharing, "fused": len(group)}
        return [
            {"key": arm["key"], "name": arm["name"], **shared, **outcome(arm, out, process, stderr, window.closed)}
            for arm, out in zip(group, outs, strict=True)
        ]


def outcome(arm: dict[str, Any], out: Path, process: subprocess.Popen, stderr: str, cut: bool) -> dict[str, Any]:
    """The arm's status and result, read from ``out`` (what its process left there)."""
    result = out / "result.json"
    if not result.is_file():
        saved = sorted(str(f.relative_to(out)) for f in out.rglob("*") if f.is_file())
        tail = stderr.strip().splitlines()[-3:]
        return {"status": "cut" if cut else "crashed", "exit": process.returncode, "stderr": tail, "saved": saved}
    stored = json.loads(result.read_text())
    if stored["key"] != arm["key"]:  # another code, data or config than the plan's: not the same run
        return {"status": "other run", "why": f"trained {stored['key']}, planned {arm['key']}"}
    return {"status": stored["summary"]["status"], "result": stored}


def run(slice_: dict[str, Any], project: Path, out: Path, workers: int, seconds: float) -> int:
    """Train the slice's groups in its order, ``workers`` at once, within ``seconds``; 0 when
    every arm finished."""
    arms = slice_["arms"]
    groups = groups_of(arms)
    with open(out, "ab") as sink:
        window = Window(sink, seconds)
        header = {"plan": slice_["plan"], "slice": slice_["slice"], "workers": workers, "window_s": seconds}
        window.write({"header": header | {"machine": machine(), "started_unix": time.time()}})
        print(
            f"slice {slice_['slice']}: {len(arms)} arms in {len(groups)} groups, {workers} at a time, {seconds:.0f} s",
            flush=True,
        )
        timer = threading.Timer(max(0.0, seconds), window.close)
        timer.start()

        def one(group: list[dict[str, Any]]) -> None:
            for arm, record in zip(group, train_group(group, project, window), strict=True):
                window.finish(arm, record)
                if record["status"] != "not started":  # those are counted at the end
                    print(f"[{time.monotonic() - window.started:5.0f}s] {arm['name']}: {record['status']}", flush=True)

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, groups))
        timer.cancel()
        wall, finished = time.monotonic() - window.started, window.finished
        window.write({"footer": {"wall_s": round(wall, 1), "finished": finished, "arms": len(arms)}})
    print(f"{finished}/{len(arms)} arms in {wall:.0f} s: {finished / (wall / 60):.2f} arms per GPU-minute", flush=True)
    if window.not_started:
        print(f"{window.not_started} arms not started: they would not have finished in the window", flush=True)
    return 0 if finished == len(arms) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tasks.gpu_study.window", description=__doc__.split("\n\n")[0])
    p.add_argument("slice", type=Path, help="the slice file `python -m flows.gpu_study slice` wrote")
    p.add_argument("--out", type=Path, required=True, help="the results file (.jsonl.gz), appended to")
    p.add_argument("--workers", type=int, required=True, help="groups (processes) at once on the GPU")
    p.add_argument("--window-s", type=float, required=True, help="seconds this window has for training")
    p.add_argument("--project", type=Path, default=Path.cwd())
    args = p.parse_args(argv)
    slice_ = json.loads(args.slice.read_text())
    return run(slice_, args.project.resolve(), args.out.resolve(), args.workers, args.window_s)


if __name__ == "__main__":  # on the GPU box, through scripts/gpu-window.sh: its own private scratch first
    sys.exit(main())
