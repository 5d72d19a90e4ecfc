"""The window's data, carried: the gpu profile's ``data/tokens`` as one xz-compressed tar under
``gpu_study/carry/``, made here (``python -m flows.gpu_study pack``) and unpacked on the GPU box
before the slice trains (scripts/gpu-window.sh). A window carries at most 64 MiB of files git
ignores, and a corpus of one epoch per arm is larger than that as raw uint16 tokens; compressed,
it fits or ``pack`` refuses it, naming both sizes. Standard library only: it runs on a bare GPU box.

    python -m tasks.gpu_study.carry unpack     # on the GPU box: gpu_study/carry/tokens.tar.xz -> data/tokens
"""

from __future__ import annotations

import argparse
import lzma
import os
import sys
import tarfile
import tempfile
from pathlib import Path

TOKENS = Path("data") / "tokens"
CARRY = Path("gpu_study") / "carry" / "tokens.tar.xz"
CARRY_LIMIT = 60 * 2**20
"""The largest archive a window is given: its carry is 64 MiB in all, and the rest is margin."""


class CarryError(Exception):
    """A carry that cannot be made or used; the message names the file and what to do."""


def pack(project: Path, limit: int = CARRY_LIMIT) -> Path:
    """``data/tokens`` as ``gpu_study/carry/tokens.tar.xz``, written whole or not at all; refused
    when larger than ``limit`` (the archive is not kept)."""
    tokens, target = project / TOKENS, project / CARRY
    if not (tokens / "manifest.json").is_file():
        raise CarryError(f"{tokens}/manifest.json: missing; build the gpu profile's data first (dvc repro tokenize)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=target.parent, prefix=".tokens-", suffix=".tar.xz")
    os.close(fd)
    try:
        with lzma.open(scratch, "wb", preset=9 | lzma.PRESET_EXTREME) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
            tar.add(tokens, arcname="tokens", filter=_plain)
        size = os.path.getsize(scratch)
        if size > limit:
            raise CarryError(
                f"{target}: the gpu profile's tokens compress to {size / 2**20:.1f} MiB, more than a window "
                f"carries ({limit / 2**20:.0f} MiB); fewer documents (data.max_docs) or a smaller vocabulary"
            )
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return target


def _plain(member: tarfile.TarInfo) -> tarfile.TarInfo:
    """The member without this machine's owner, group and times: the archive depends on the data."""
    member.uid = member.gid = 0
    member.uname = member.gname = ""
    member.mtime = 0
    return member


def unpack(project: Path) -> Path:
    """``gpu_study/carry/tokens.tar.xz`` into ``data/tokens`` (refused if that exists: a window
    never trains on other data than the plan's, and the arms' identities would say so anyway)."""
    archive, tokens = project / CARRY, project / TOKENS
    if tokens.exists():
        raise CarryError(f"{tokens}: exists already; the carried tokens are not unpacked over it")
    if not archive.is_file():
        raise CarryError(f"{archive}: missing; carry it to the window (python -m flows.gpu_study pack makes it)")
    tokens.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tokens.parent) as scratch, tarfile.open(archive, "r:xz") as tar:
        tar.extractall(scratch, filter="data")  # no absolute paths, links out or device files
        os.replace(Path(scratch) / "tokens", tokens)
    return tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tasks.gpu_study.carry", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["unpack"])
    p.add_argument("--project", type=Path, default=Path.cwd())
    args = p.parse_args(argv)
    try:
        print(f"unpacked -> {unpack(args.project.resolve())}")
    except CarryError as e:
        print(f"carry: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # on the GPU box, through scripts/gpu-window.sh: its own private scratch first
    sys.exit(main())
