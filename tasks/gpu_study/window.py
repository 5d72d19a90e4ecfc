"""Train one slice of the gpu study on the machine it runs on: the slice's arms, ``--workers`` at
once as separate processes sharing the GPU, each exactly as ``python -m tasks.ablate.arm`` trains
it. Each result is appended to one gzipped JSON-lines file as it finishes, so a window that closes
early keeps every arm it finished. Imports the standard library only (the arms import torch,
numpy and pyyaml): it runs on a bare GPU box.

    python -m tasks.gpu_study.window gpu_study/slices/01.json --out $OUT/01.jsonl.gz --workers 8 --window-s 480

The file's first line is the window's header (plan, slice, GPU, driver, torch, host), then one line
per arm (its result.json, its wall time, the processes sharing the GPU while it ran), and a last
line with the window's totals. No arm starts that its slice's estimate says cannot finish before
``--window-s``; an arm still running then is stopped and recorded as cut (its partial work is lost:
a window is for finished arms).
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
MARGIN = 1.3
"""An arm is not started unless the window has this times its estimate left (tasks/gpu_study/plan.py)."""
GRACE_S = 5.0
"""How long an arm the window cuts has to exit after SIGTERM before it is killed."""


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
    """The window's clock, its sink, and the arms running in it."""

    def __init__(self, sink: BinaryIO, seconds: float) -> None:
        self.started = time.monotonic()
        self.seconds = seconds
        self.sink = sink
        self.lock = threading.Lock()
        self.running: dict[str, subprocess.Popen] = {}
        self.measured: dict[str, float] = {}  # per family, the slowest finished arm's wall seconds
        self.finished = 0
        self.not_started = 0
        self.closed = False

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)

    def write(self, record: dict[str, Any]) -> None:
        with self.lock:
            self.sink.write(gzip.compress(json.dumps(record, allow_nan=False).encode() + b"\n"))
            self.sink.flush()

    def close(self) -> None:
        """Stop every arm still running (the window's time is up)."""
        with self.lock:
            self.closed = True
            running = list(self.running.values())
        for process in running:
            process.terminate()
        for process in running:
            try:
                process.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()

    def estimate(self, arm: dict[str, Any]) -> float | None:
        """The slice's estimate of the arm's seconds, else this window's own measure of its family."""
        if arm.get("estimate_s") is not None:
            return float(arm["estimate_s"])
        with self.lock:
            seen = self.measured.get(arm["family"])
        return None if seen is None else seen * MARGIN

    def finish(self, arm: dict[str, Any], record: dict[str, Any]) -> None:
        self.write({"arm": record})
        if record["status"] == "not started":
            with self.lock:
                self.not_started += 1
        if record["status"] in ("completed", "diverged"):
            with self.lock:
                self.finished += 1
                self.measured[arm["family"]] = max(self.measured.get(arm["family"], 0.0), record["wall_s"])


def train_arm(arm: dict[str, Any], project: Path, window: Window) -> dict[str, Any]:
    """One arm in a fresh process, in a scratch directory: its record for the results file."""
    estimate_s = window.estimate(arm)
    if window.closed or (estimate_s is not None and window.left() < estimate_s):
        return {
            "key": arm["key"],
            "name": arm["name"],
            "status": "not started",
            "why": "would not finish in the window",
        }
    with tempfile.TemporaryDirectory(prefix="arm-") as scratch:
        arguments = list(arm["arguments"])
        arguments[arguments.index("--out") + 1] = scratch
        env = {**os.environ, "PYTHONPATH": str(project)}
        started = time.monotonic()
        with window.lock:
            if window.closed:
                return {"key": arm["key"], "name": arm["name"], "status": "not started", "why": "window closed"}
            sharing = len(window.running) + 1
            process = subprocess.Popen(
                [sys.executable, *ARM, *arguments],
                cwd=project,
                env=env,
                stderr=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                text=True,
            )
            window.running[arm["key"]] = process
        _, stderr = process.communicate()
        with window.lock:
            window.running.pop(arm["key"], None)
        record = {"key": arm["key"], "name": arm["name"], "wall_s": round(time.monotonic() - started, 2)}
        record["sharing"] = sharing
        result = Path(scratch) / "result.json"
        if not result.is_file():
            cut = window.closed
            tail = stderr.strip().splitlines()[-3:]
            saved = sorted(str(f.relative_to(scratch)) for f in Path(scratch).rglob("*") if f.is_file())
            return record | {
                "status": "cut" if cut else "crashed",
                "exit": process.returncode,
                "stderr": tail,
                "saved": saved,
            }
        stored = json.loads(result.read_text())
        if stored["key"] != arm["key"]:  # another code, data or config than the plan's: not the same run
            return record | {"status": "other run", "why": f"trained {stored['key']}, planned {arm['key']}"}
        return record | {"status": stored["summary"]["status"], "result": stored}


def run(slice_: dict[str, Any], project: Path, out: Path, workers: int, seconds: float) -> int:
    """Train the slice's arms in its order within ``seconds``; 0 when every arm finished."""
    arms = slice_["arms"]
    with open(out, "ab") as sink:
        window = Window(sink, seconds)
        header = {"plan": slice_["plan"], "slice": slice_["slice"], "workers": workers, "window_s": seconds}
        window.write({"header": header | {"machine": machine(), "started_unix": time.time()}})
        print(f"slice {slice_['slice']}: {len(arms)} arms, {workers} at a time, {seconds:.0f} s", flush=True)
        timer = threading.Timer(max(0.0, seconds), window.close)
        timer.start()

        def one(arm: dict[str, Any]) -> None:
            record = train_arm(arm, project, window)
            window.finish(arm, record)
            if record["status"] != "not started":  # those are counted at the end
                print(f"[{time.monotonic() - window.started:5.0f}s] {arm['name']}: {record['status']}", flush=True)

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, arms))
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
    p.add_argument("--workers", type=int, required=True, help="arms at once on the GPU")
    p.add_argument("--window-s", type=float, required=True, help="seconds this window has for training")
    p.add_argument("--project", type=Path, default=Path.cwd())
    args = p.parse_args(argv)
    slice_ = json.loads(args.slice.read_text())
    return run(slice_, args.project.resolve(), args.out.resolve(), args.workers, args.window_s)


if __name__ == "__main__":  # on the GPU box, through scripts/gpu-window.sh: its own private scratch first
    sys.exit(main())
