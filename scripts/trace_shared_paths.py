"""Which paths outside the checkout a command and everything it starts create, write or open in
the machine's shared folders: measured with strace, not guessed.

    python scripts/trace_shared_paths.py [--out trace.txt] -- make repro
    python scripts/trace_shared_paths.py --commands docs/traced-commands.txt

Runs the command (or each line of ``--commands``, by bash, in turn, from the checkout) under ``strace -f`` (file and socket-bind calls only) and prints, for each path
outside the checkout and its state directory that a process created, wrote or opened in a shared
folder (/tmp, /var/tmp, /dev/shm, /run/lock), the calls seen and its owner and mode afterwards
(``gone`` when removed by the end). Writes elsewhere outside the checkout (the user's home, the
package caches) are listed apart: only the owner can write there. Exit 1 when something other than
a semaphore was made or written in a shared folder. Needs strace (``apt-get install strace``).
strace follows every process a command starts until it ends: a command that leaves a server
running is traced until the server stops (so a traced line that starts servers stops them too).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

SHARED = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
"""Folders every local user can write (sticky or not): a predictable name there can be planted."""
SEMAPHORES = "/dev/shm/sem."
"""glibc's POSIX semaphores (``sem_open``: multiprocessing, loky): listed, but no reason to fail.
Their names are random, made with ``O_EXCL`` and unlinked at once, and nothing moves them."""
CALLS = "open,openat,openat2,creat,mkdir,mkdirat,rename,renameat,renameat2,symlink,symlinkat,link,linkat,bind"
WRITES = re.compile(r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC|O_APPEND")
QUOTED = re.compile(r'(?:(\d+)<([^>]*)>, )?"((?:[^"\\]|\\.)*)"')
"""A quoted path argument, with the directory descriptor strace's ``-y`` prints before it."""
LINE = re.compile(r"^(\d+) +(\w+)\((.*)\) += (-?\d+|\?)")
IGNORED = ("/dev/null", "/dev/tty", "/dev/pts/", "/proc/", "/sys/", "/dev/urandom", "/dev/random")


def trace(command: list[str], out: Path) -> int:
    """Run ``command`` under strace (following every child), its trace in ``out``; its exit code."""
    strace = shutil.which("strace")
    if strace is None:
        sys.exit("trace_shared_paths: strace is not installed (apt-get install strace)")
    args = [strace, "-f", "-qq", "-y", "-s", "512", "--seccomp-bpf", "-e", f"trace={CALLS}", "-o", str(out)]
    return subprocess.call([*args, "--", *command])


def touched(out: Path) -> dict[str, set[str]]:
    """Every absolute path in the trace that a call succeeded on, with what was done to it:
    ``write`` (opened to write, or created), ``read``, ``mkdir``, ``rename``, ``link``, ``bind``."""
    seen: dict[str, set[str]] = defaultdict(set)
    for line in out.read_text(errors="replace").splitlines():
        if not (m := LINE.match(line)) or m.group(4).startswith("-"):
            continue
        call, args = m.group(2), m.group(3)
        for base, name in ((b, n) for _, b, n in QUOTED.findall(args)):
            path = os.path.normpath(os.path.join(base, name) if base and not name.startswith("/") else name)
            if path.startswith("/"):
                seen[path].add(kind(call, args))
    return seen


def kind(call: str, args: str) -> str:
    if call.startswith("open") or call == "creat":
        return "write" if call == "creat" or WRITES.search(args) else "read"
    return {"mkdir": "mkdir", "mkdirat": "mkdir", "bind": "bind"}.get(call, "rename" if "rename" in call else "link")


def outside(path: str, keep: tuple[str, ...]) -> bool:
    return not any(path == k or path.startswith(k.rstrip("/") + "/") for k in keep) and not path.startswith(IGNORED)


def top(path: str) -> str:
    """The entry right under its shared folder (``/tmp/dask-scratch-space/x`` → ``/tmp/dask-scratch-space``):
    what another user could plant first."""
    for root in SHARED:
        if path.startswith(root + "/"):
            return root + "/" + path[len(root) + 1 :].split("/")[0]
    return path


RANDOM = re.compile(r"(?<=[-_.])[A-Za-z0-9_]{6,}$|(?<=^tmp)[A-Za-z0-9_]{8}(?=$|[.])|(?<=-)\d+(?=-)|^[a-z0-9_]{8}$")
"""The random part of a name ``mkdtemp``, ``NamedTemporaryFile``, pip, SQLite or a semaphore picks
(``tmpk2pt6sbk``, ``pip-unpack-005p80tb``, ``etilqs_3662d45e590d234d``, ``sem.mp-1a1q6tjg``), and a
pid inside one (``sem.loky-9189-…``)."""


def template(path: str) -> str:
    """``path`` with its random parts as ``*``: one line for each kind of name."""
    folder, _, name = path.rpartition("/")
    for _ in range(2):
        name = RANDOM.sub("*", name)
    return f"{folder}/{name}"


def describe(path: str) -> str:
    """Owner and mode of ``path`` now, or ``gone``."""
    try:
        info = os.lstat(path)
    except OSError:
        return "gone"
    kind = "dir" if stat.S_ISDIR(info.st_mode) else "link" if stat.S_ISLNK(info.st_mode) else "file"
    return f"{kind} uid {info.st_uid} mode {stat.S_IMODE(info.st_mode):04o}"


def report(seen: dict[str, set[str]], keep: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Lines for the shared folders' entries, one for each kind of name (with how many there were,
    what was done to them, and owner and mode now), and the other folders written."""
    shared: dict[str, set[str]] = defaultdict(set)
    elsewhere: set[str] = set()
    for path, kinds in seen.items():
        if not outside(path, keep):
            continue
        if path.startswith(tuple(root + "/" for root in SHARED)):
            shared[top(path)] |= kinds
        elif kinds - {"read"} and not path.startswith(("/dev/", "/etc/ld.so")):
            elsewhere.add(str(Path(path).parent))
    kinds: dict[str, list[str]] = defaultdict(list)
    for path in shared:
        kinds[template(path)].append(path)
    lines = []
    for name, paths in sorted(kinds.items()):
        done = sorted(set().union(*(shared[p] for p in paths)))
        now = sorted({describe(p) for p in paths})
        lines.append(f"{name}  x{len(paths)}  [{','.join(done)}]  now: {'; '.join(now)}")
    return lines, sorted(elsewhere)


def commands_in(listing: Path) -> list[list[str]]:
    """The commands of a ``--commands`` file: one a line, for bash; blank lines and ``#`` comments skipped."""
    lines = (line.strip() for line in listing.read_text().splitlines())
    return [["bash", "-c", line] for line in lines if line and not line.startswith("#")]


def trace_and_report(command: list[str], keep: tuple[str, ...], out: Path | None) -> bool:
    """Trace ``command`` and print what it did outside ``keep``; whether it made or wrote anything
    other than a semaphore in a shared folder."""
    with contextlib.nullcontext(out.parent) if out else tempfile.TemporaryDirectory() as scratch:
        trace_file = out or Path(scratch) / "trace.txt"
        rc = trace(command, trace_file)
        shared, elsewhere = report(touched(trace_file), keep)
    shown = command[2] if command[:2] == ["bash", "-c"] else shlex.join(command)
    print(f"traced: {shown} (exit {rc}); outside {', '.join(keep)}")
    print(f"shared folders ({len(shared)}):", *shared or ["(none)"], sep="\n  ")
    print(f"written elsewhere, by folder ({len(elsewhere)}):", *elsewhere or ["(none)"], sep="\n  ", flush=True)
    return any(not line.startswith(SEMAPHORES) and {"write", "mkdir", "bind"} & kinds(line) for line in shared)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out",
        type=Path,
        help="keep the raw trace here (default: a temporary file, removed); with --commands, the last one's",
    )
    p.add_argument("--keep", action="append", default=[], help="another folder whose writes are expected")
    p.add_argument("--commands", type=Path, help="a file of commands to trace in turn, one a line (bash)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if bool(command) == bool(args.commands):
        p.error("give one command to trace after --, or --commands FILE")
    checkout = str(Path.cwd().resolve())
    state = os.environ.get("SPIKELAB_STATE", "")
    keep = tuple(filter(None, (checkout, state, *args.keep)))
    commands = commands_in(args.commands) if args.commands else [command]
    wrote = [c[-1] for c in commands if trace_and_report(c, keep, args.out)]
    if args.commands:
        print(
            f"{len(commands)} commands traced; {len(wrote)} made or wrote a name in a shared folder", *wrote, sep="\n  "
        )
    return 1 if wrote else 0


def kinds(line: str) -> set[str]:
    """What a report line says was done (``[mkdir,read,write]``)."""
    return set(line.split("[", 1)[1].split("]", 1)[0].split(","))


if __name__ == "__main__":
    sys.exit(main())
