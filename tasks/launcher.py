"""A warm launcher for stage processes: ``spikelab run`` without paying for the imports.

A stage is a fresh process (DVC runs ``spikelab run <stage>``), and before its own work that
process spends ~3 CPU-seconds importing prefect and mlflow (benchmarks/bench_overhead.py): more
than the work of most data stages. ``spikelab services up`` therefore also starts a launcher,
which imports the heavy third-party libraries once (with the cyclic GC paused, then frozen:
tasks/startup.py) and then forks a child per request, the way a zygote or multiprocessing's
forkserver does. A ``spikelab run`` that finds a launcher for its environment hands it its
command line, working directory, environment and standard streams (passed as file descriptors),
and waits for the child's exit code; with no launcher it runs in-process, as before.

The child behaves as ``spikelab run`` would have in-process:
  * code: it drops every module of this project (``flows``, ``tasks``, ``model``) the launcher
    had loaded and imports them afresh, so a stage always runs the code on disk (DVC hashes it);
    only third-party libraries come from the launcher, and the launcher is keyed on the
    virtualenv's contents, so a reinstall makes clients pass it by;
  * settings: Prefect reads its settings at import, so the launcher is keyed on every
    ``PREFECT_*`` setting (after :func:`tasks.paths.configure_environment`) and on the state
    directory; a client whose settings differ (another checkout, a test's own servers) does not
    find it and runs in-process;
  * streams, cwd, environment and argv are the client's; the exit code is the child's;
  * signals: the client forwards SIGINT/SIGTERM/SIGHUP to the child, and a client killed outright
    (``kill -9``) gives the child SIGTERM (a training stage then checkpoints, as when preempted).

``SPIKELAB_LAUNCHER=0`` turns it off for a command. The launcher is Linux-only (abstract unix
sockets, fork); elsewhere ``spikelab run`` simply runs in-process.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import signal
import socket
import struct
import sys
import sysconfig
import threading
from pathlib import Path

from tasks import paths

SWITCH_ENV = "SPIKELAB_LAUNCHER"
"""``0`` runs ``spikelab run`` in-process even where a launcher is up (children get it too)."""

PRELOAD = ("prefect", "prefect.flow_engine", "prefect.client.orchestration", "prefect.task_runners",
           "prefect.artifacts", "mlflow", "mlflow.tracking", "torch", "numpy", "scipy.stats",
           "optuna", "matplotlib", "yaml", "psutil")
"""Third-party modules the stages import; nothing of this project (stages import that afresh)."""

PROJECT_PACKAGES = ("flows", "tasks", "model")
_CODE = struct.Struct("!i")
_MESSAGE_LIMIT = 1 << 20


def enabled() -> bool:
    return sys.platform == "linux" and os.environ.get(SWITCH_ENV, "1") != "0"


def address() -> str:
    """The launcher's abstract socket name for this process's settings: the state directory, the
    Prefect settings in the environment, the interpreter and the virtualenv's contents."""
    site = sysconfig.get_paths()["purelib"]
    key = {"state": str(paths.state_dir()), "python": sys.executable,
           "site": os.stat(site).st_mtime_ns,
           "prefect": sorted((k, v) for k, v in os.environ.items()
                             if k.startswith("PREFECT_") and not k.startswith("PREFECT__"))}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return f"\0spikelab-launcher-{digest}"


# ---------------------------------------------------------------------------------------------
# Client: spikelab run
# ---------------------------------------------------------------------------------------------


def run_in_launcher(argv: list[str], module: str | None = None, code: str | None = None) -> int | None:
    """Run ``python -m module *argv`` (or ``python -c code``) in the launcher serving this
    environment and return its exit code, or None when no launcher serves it (the caller then
    runs in-process)."""
    if not enabled():
        return None
    paths.configure_environment()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(address())
    except OSError:
        conn.close()
        return None
    streams = [fd for fd in (0, 1, 2) if _is_open(fd)]
    request = {"module": module, "code": code, "argv": [sys.argv[0], *argv], "cwd": os.getcwd(),
               "env": dict(os.environ), "path0": sys.path[0], "streams": streams}
    socket.send_fds(conn, [json.dumps(request).encode()], streams)
    reply = conn.recv(_CODE.size)
    if not reply:
        return None  # the launcher closed before it forked (stopping): nothing ran
    (child,) = _CODE.unpack(reply)
    with forwarded_signals(child):
        reply = conn.recv(_CODE.size)
    if not reply:
        print(f"spikelab: the launcher stopped while stage process {child} ran; its exit status is unknown",
              file=sys.stderr)
        return 1
    code = _CODE.unpack(reply)[0]
    return 128 - code if code < 0 else code  # killed by a signal: the shell's convention


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


class forwarded_signals:
    """While waiting, pass the signals a terminal or DVC sends to the stage process instead."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, pid: int):
        self.pid = pid

    def _forward(self, signum, _frame) -> None:
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def __enter__(self):
        self.previous = {s: signal.signal(s, self._forward) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


# ---------------------------------------------------------------------------------------------
# Server: python -m tasks.launcher (started by spikelab services up)
# ---------------------------------------------------------------------------------------------


def serve() -> None:
    """Import :data:`PRELOAD`, then fork a child per request until terminated."""
    import importlib
    import selectors

    from tasks.startup import imports_without_gc

    paths.configure_environment()
    with imports_without_gc():
        for name in PRELOAD:
            importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address())
    listener.listen(64)
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of exits
    print(f"launcher: ready, {len(PRELOAD)} modules preloaded, {threading.active_count()} thread(s)", flush=True)
    waiting: dict[int, socket.socket] = {}  # child pid -> its client's connection
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is wake_r:
                wake_r.recv(4096)
                report_exits(waiting)
                continue
            conn, _ = listener.accept()
            pid = os.fork()
            if pid == 0:
                selector.close()
                for fd in (listener, wake_r, wake_w, *waiting.values()):
                    fd.close()
                run_child(conn)  # never returns
            waiting[pid] = conn


def report_exits(waiting: dict[int, socket.socket]) -> None:
    """Reap every child that has ended and send its exit code to the client waiting on it."""
    while waiting:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            try:
                conn.send(_CODE.pack(os.waitstatus_to_exitcode(status)))
            except OSError:
                pass  # the client is gone
            conn.close()


def run_child(conn: socket.socket) -> None:
    """In the forked child: become the client's ``python -m module``; exits with its code."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setpgid(0, 0)  # stopping the launcher's process group leaves running stages alone
    message, fds, _, _ = socket.recv_fds(conn, _MESSAGE_LIMIT, 3)
    if not message:  # a probe (start() waiting for it), no request
        os._exit(0)
    request = json.loads(message)
    received = dict(zip(request["streams"], fds))
    for target in (0, 1, 2):  # the client's streams; /dev/null for one it had closed
        fd = received.get(target) or os.open(os.devnull, os.O_RDWR)
        os.dup2(fd, target)
        os.close(fd)
    conn.send(_CODE.pack(os.getpid()))
    threading.Thread(target=_terminate_when_client_goes, args=(conn,), daemon=True).start()
    become(request)


def become(request: dict) -> None:
    import importlib
    import runpy

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[SWITCH_ENV] = "0"  # run in this process, and stages' own children likewise
    sys.argv = request["argv"]
    sys.path[0] = request["path0"]
    for name in [m for m in sys.modules if m.split(".")[0] in PROJECT_PACKAGES]:
        del sys.modules[name]
    importlib.invalidate_caches()
    sys.stdout.reconfigure(line_buffering=os.isatty(1))
    try:
        if request["module"]:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as stop:
        exit_quickly(stop.code)
    exit_quickly(0)


def exit_quickly(code: object) -> None:
    """End the child as the interpreter would, less the teardown of every module the launcher
    loaded (over half a second, for memory the kernel frees anyway): wait for the non-daemon
    threads, run the exit handlers (Prefect and MLflow flush their logs and events there), flush
    the streams, then exit. The two hooks are CPython's own shutdown steps, called in its order."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status & 0xFF)


def _terminate_when_client_goes(conn: socket.socket) -> None:
    """The client never sends after its request: a read returning means it exited or died."""
    try:
        conn.recv(1)
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


# ---------------------------------------------------------------------------------------------
# Lifecycle (spikelab services up / down / status)
# ---------------------------------------------------------------------------------------------


def record_file() -> Path:
    return paths.state().services / "launcher.json"


def started_process():
    """The live launcher ``start`` recorded for this state directory, or None."""
    import psutil

    try:
        record = json.loads(record_file().read_text())
        proc = psutil.Process(record["pid"])
        return proc if abs(proc.create_time() - record["create_time"]) < 0.01 else None
    except (OSError, ValueError, KeyError, psutil.Error):
        return None


def start(timeout: float = 120.0) -> None:
    """Start the launcher for this environment (after the servers answer: it is keyed on the
    settings that choose them) and wait until it takes requests."""
    import subprocess
    import time

    import psutil

    paths.configure_environment()
    where = address()
    if started_process() is not None:
        if json.loads(record_file().read_text()).get("address") == where[1:]:
            print("launcher: already started for this checkout")
            return
        stop()  # keyed on other libraries or settings than the current ones
    log_path = paths.state().services / "launcher.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tasks.launcher"], cwd=paths.project_dir(), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    record = {"pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(), "address": where[1:]}
    record_file().write_text(json.dumps(record))
    deadline = time.monotonic() + timeout
    while not answers(where):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop()
            raise SystemExit(f"launcher: did not start; see {log_path}")
        time.sleep(0.2)
    print(f"launcher: up (pid {proc.pid}); spikelab run forks stages from it")


def answers(where: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        try:
            probe.connect(where)
            return True
        except OSError:
            return False


def stop() -> None:
    """Stop this checkout's launcher; stages it started run on."""
    proc = started_process()
    if proc is not None:
        proc.terminate()  # its children run on: each stage is its own process group
        proc.wait(timeout=30)
        print(f"launcher: stopped (pid {proc.pid})")
    record_file().unlink(missing_ok=True)


def status() -> str:
    proc = started_process()
    return f"up (pid {proc.pid}, this checkout)" if proc is not None else "down"


if __name__ == "__main__":
    serve()
