"""Another local user cannot become the store a torchrun run rendezvous through (issue #55).

torch's TCPStore has no login: whoever runs the store steers the ranks, and torchrun's c10d
rendezvous unpickles what it answers. ``nobody`` (tests/other_user.py) listens first on a port; the
old documented command connects to it, the documented ones never do, and the trainer itself
refuses a store it did not start (model/distributed.py, ``check_store``).

Each torchrun is bounded in time and its process group killed in a ``finally``."""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from model.distributed import (
    TRUSTED_STORE_ENV,
    check_store,
    is_this_machine,
    listening_uids,
    store_refusal,
)
from model.typed_config import UserError
from tests.other_user import OTHER, start_as_other_user
from tests.test_ddp import cli, inputs, rank_output  # noqa: F401  (inputs: a fixture, used by tiny)

ROOT = Path(__file__).resolve().parents[1]
PORTS = range(29611, 29651)  # this file's share of the test ports
OLD_COMMAND = ("--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint")
"""What docs/pretrain.md told users to type before issue #55 (then ``127.0.0.1:29400``)."""
OTHER_UID = pwd.getpwnam(OTHER).pw_uid if OTHER in {u.pw_name for u in pwd.getpwall()} else None

needs_torchrun = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not in this torch build",
)

LISTENER = """
import socket, sys

def uid_of(peer_port, port):  # the uid of the socket that connected from peer_port
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            f = row.split()
            if int(f[1].rsplit(":", 1)[1], 16) == peer_port and int(f[2].rsplit(":", 1)[1], 16) == port:
                return f[7]
    return "?"

wait = float(sys.argv[1])
for port in map(int, sys.argv[2:]):
    try:
        server = socket.create_server(("127.0.0.1", port))
        break
    except OSError:
        continue
else:
    sys.exit("no free port")
print("listening", port, flush=True)
server.settimeout(wait)
while True:
    try:
        conn, (_, peer) = server.accept()
    except socket.timeout:
        print("no more connections", flush=True)
        break
    conn.settimeout(1)
    try:
        first = conn.recv(64)
    except OSError:
        first = b""
    if first == b"end":
        print("end", flush=True)
        break
    print("connection from uid", uid_of(peer, port), "sent", first[:16].hex(), flush=True)
"""
"""Another user's server listening first on loopback (the first free port of ``sys.argv[2:]``),
prints its port; for each connection prints the uid that made it and its first bytes, until one
sends ``end`` or none comes for ``sys.argv[1]`` seconds."""


class Squatter:
    """:data:`LISTENER` run as ``nobody``, listening."""

    def __init__(self, wait: float) -> None:
        self.proc = start_as_other_user(LISTENER, str(wait), *map(str, PORTS))
        first = self.next_line()
        assert first.startswith("listening "), first + self.proc.stderr.read()
        self.port = int(first.split()[1])

    def next_line(self) -> str:
        return self.proc.stdout.readline().strip()

    def connections(self) -> list[str]:
        """Every connection it got: a last one of ours (``end``) is answered after all earlier ones."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(b"end")
        lines = []
        while (line := self.next_line()) not in ("end", ""):
            lines.append(line)
        assert line == "end", f"the listener ended early: {self.proc.stderr.read()}"
        return [line for line in lines if line.startswith("connection")]


@pytest.fixture(scope="module")
def tiny(request) -> Path:
    """The tiny run's token files and config (tests/test_ddp.py's ``inputs``)."""
    return request.getfixturevalue("inputs")


@pytest.fixture
def squatter() -> Iterator[Squatter]:
    squatter = Squatter(wait=60)
    try:
        yield squatter
    finally:
        squatter.proc.kill()
        squatter.proc.wait()


@contextlib.contextmanager
def torchrun(flags: list[str], target: list[str], logs: Path, **env: str) -> Iterator[subprocess.Popen]:
    """``torchrun flags target`` on loopback, each rank's output in ``logs``; on leaving, killed with
    its ranks if still running."""
    command = [sys.executable, "-m", "torch.distributed.run", *flags, "--log-dir", str(logs), "--redirects", "3"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **env}
    proc = subprocess.Popen(
        [*command, *target], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def documented_torchruns(doc: str = "docs/pretrain.md") -> list[list[str]]:
    """The launcher flags of each torchrun command in ``doc``'s bash blocks (between ``torchrun``
    and ``-m``)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    commands = [shlex.split(line, comments=True) for line in lines if "torchrun " in line]
    return [words[words.index("torchrun") + 1 : words.index("-m")] for words in commands]


def with_values(flags: list[str], **values: str) -> list[str]:
    """``flags`` with the value after ``--name-with-dashes`` replaced for each ``name_with_dashes``."""
    flags = list(flags)
    for name, value in values.items():
        flags[flags.index("--" + name.replace("_", "-")) + 1] = value
    return flags


# --- the attack and the documented commands, end to end -------------------------------------------


@pytest.mark.scaleout
@needs_torchrun
def test_control_the_old_documented_command_makes_torchrun_a_client_of_another_users_store(squatter, tiny, tmp_path):
    flags = [*OLD_COMMAND, f"127.0.0.1:{squatter.port}", "--rdzv-conf", "timeout=5,join_timeout=5,read_timeout=5"]
    with torchrun(flags, cli(tiny, "old"), tmp_path / "logs"):
        got = squatter.next_line()  # as soon as it connects (or after the listener's 60 s)
    assert got.startswith(f"connection from uid {os.getuid()} sent "), got


@pytest.mark.scaleout
@needs_torchrun
def test_the_documented_single_node_command_hosts_its_own_store_and_trains(squatter, tiny, tmp_path):
    (flags,) = [f for f in documented_torchruns() if "--standalone" in f]
    assert "--rdzv-endpoint" not in flags and with_values(flags, nproc_per_node="2") == flags
    with torchrun(flags, cli(tiny, "standalone"), tmp_path / "logs") as proc:
        out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out
    assert '"status": "completed"' in rank_output(tmp_path / "logs", 0)  # both ranks joined its store
    assert squatter.connections() == []


@pytest.mark.scaleout
@needs_torchrun
def test_the_documented_head_node_exits_rather_than_join_a_store_on_its_port(squatter, tiny, tmp_path):
    head, other = documented_torchruns()[-2:]
    assert with_values(head, node_rank="0") == head and with_values(other, node_rank="1") == other
    flags = with_values(head, nproc_per_node="1", master_addr="127.0.0.1", master_port=str(squatter.port))
    with torchrun(flags, cli(tiny, "head"), tmp_path / "logs") as proc:
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "EADDRINUSE" in out, out
    assert squatter.connections() == []


@pytest.mark.scaleout
@needs_torchrun
def test_the_documented_two_node_recipe_trains_with_the_store_node_0_hosts(tiny, tmp_path):
    head, other = documented_torchruns()[-2:]
    port = next(p for p in PORTS if port_is_free(p))
    loopback = dict(nproc_per_node="1", master_addr="127.0.0.1", master_port=str(port))
    with (
        torchrun(with_values(head, **loopback), cli(tiny, "two-nodes"), tmp_path / "logs0") as node0,
        torchrun(with_values(other, **loopback), cli(tiny, "two-nodes"), tmp_path / "logs1") as node1,
    ):
        outs = [proc.communicate(timeout=90)[0] for proc in (node0, node1)]
    assert [node0.returncode, node1.returncode] == [0, 0], outs
    assert '"status": "completed"' in rank_output(tmp_path / "logs0", 0)


# --- the trainer's own check ------------------------------------------------------------------------


@pytest.mark.parametrize("rank", ["0", "1"])
def test_the_trainer_exits_2_naming_the_store_when_another_user_listens_on_master_port(squatter, tiny, rank):
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env |= {"MASTER_PORT": str(squatter.port), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, *cli(tiny, "refused")], env={**os.environ, **env}, cwd=ROOT, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    store = f"127.0.0.1:{squatter.port}"
    assert line.startswith(f"spikelab: error: refusing to join the rendezvous store {store}: "), line
    assert f"uid {OTHER_UID}" in line and "torchrun --standalone" in line and "docs/pretrain.md" in line
    assert squatter.connections() == []


def test_a_store_this_user_listens_on_is_accepted_and_one_of_another_user_refused(squatter):
    with socket.create_server(("127.0.0.1", 0)) as mine:
        env = {"RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(mine.getsockname()[1])}
        check_store(env)
    with pytest.raises(UserError, match=f"belongs to uid {OTHER_UID}, not to you"):
        check_store({**env, "MASTER_PORT": str(squatter.port), TRUSTED_STORE_ENV: f"127.0.0.1:{squatter.port}"})


# --- the decision, on given facts -------------------------------------------------------------------

TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:7345 00000000:0000 0A 00000000:00000000 00:00000000 00000000 65534        0 1 1
   1: 0100007F:7345 0100007F:A000 01 00000000:00000000 00:00000000 00000000     7        0 2 1
   2: 00000000:7346 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 3 1
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:7345 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4 1
"""


def test_the_uids_listening_on_a_port_are_read_from_proc_net_tcp_and_tcp6():
    assert listening_uids(TCP, 0x7345) == {65534}  # not uid 7's connection from that port
    assert listening_uids(TCP, 0x7346) == {1000}
    assert listening_uids(TCP6, 0x7345) == {1000}
    assert listening_uids(TCP, 29400) == set() == listening_uids(TCP6, 0x7346)


def test_a_local_store_is_joined_only_when_this_user_alone_listens_there():
    decide = lambda owners, hosts_itself=False, trusted=None: store_refusal(  # noqa: E731
        "127.0.0.1:29400", local=True, owners=owners, uid=1000, trusted=trusted, hosts_itself=hosts_itself
    )
    assert decide({1000}) is None
    assert "uid 65534, not to you (uid 1000)" in decide({65534})
    assert "uid 65534" in decide({1000, 65534}) and "uid 65534" in decide({65534}, trusted="127.0.0.1:29400")
    assert "nothing of yours listens there" in decide(set())
    assert decide(set(), hosts_itself=True) is None  # rank 0 binds it, or fails to: never a client
    assert "uid 65534" in decide({65534}, hosts_itself=True)


def test_a_store_on_another_machine_is_refused_unless_the_user_trusts_exactly_it():
    decide = lambda trusted: store_refusal(  # noqa: E731
        "10.0.0.1:29400", local=False, owners=set(), uid=1000, trusted=trusted, hosts_itself=False
    )
    refused = decide(None)
    assert "another machine" in refused and f"set {TRUSTED_STORE_ENV}=10.0.0.1:29400" in refused
    assert "torchrun --standalone" in refused
    assert decide("10.0.0.1:29401") and decide("10.0.0.1") and decide("10.0.0.2:29400")
    assert decide("10.0.0.1:29400") is None


def test_loopback_and_this_hosts_own_names_are_this_machine_and_others_are_not():
    assert is_this_machine("127.0.0.1") and is_this_machine("localhost") and is_this_machine(socket.getfqdn())
    assert is_this_machine("::1") or not socket.has_ipv6
    assert not is_this_machine("192.0.2.1")  # TEST-NET-1: never assigned
    assert not is_this_machine("no-such-host.invalid")


def port_is_free(port: int) -> bool:
    try:
        socket.create_server(("127.0.0.1", port)).close()
        return True
    except OSError:
        return False
