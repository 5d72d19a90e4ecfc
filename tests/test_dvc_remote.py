"""The study's outputs through a DVC remote, as a worker node gets them: the data stages run in one
clone, ``dvc push``; a fresh ``git clone`` elsewhere ``dvc pull``s byte-identical outputs and DVC
sees nothing to rerun. A shared-path remote, and an S3 remote served by moto on loopback that
checks signatures, its credentials only in the environment or a credentials file outside git."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.smoke_study import REPO, VENV_BIN, copy_project
from tests.test_services import free_port  # noqa: E402
from tests.test_ui import tree_digest

pytestmark = [pytest.mark.scaleout, pytest.mark.e2e]  # e2e: the stages run against the live servers
DATA_STAGES = ("prepare", "filter", "tokenize")
WORKER_STAGE = "tokenize"  # data/tokens: what an arm, a trial or a torchrun rank reads
BUCKET = "spikelab-dvc"
MOTO_LIFETIME_S = 300


def cmd(args: list[str], cwd: Path, env: dict[str, str], transcript: list[str] | None = None) -> str:
    """Run one command of the recipe; its output is kept in ``transcript`` (searched for secrets)."""
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if transcript is not None:
        transcript.append(done.stdout + done.stderr)
    assert done.returncode == 0, f"{' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


def git_commit(project: Path, env: dict[str, str], message: str) -> None:
    cmd(["git", "add", "-A"], project, env)
    cmd(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message], project, env)


def produced_outputs(project: Path) -> dict[str, str]:
    """sha256 of every file the data stages wrote (cached outs and git-tracked ones alike)."""
    lock = yaml.safe_load((project / "dvc.lock").read_text(encoding="utf-8"))["stages"]
    outs = [out["path"] for stage in ("params", *DATA_STAGES) for out in lock[stage]["outs"]]
    return tree_digest(project, *outs)


@pytest.fixture(scope="module")
def origin(live_services, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The head node's clone: the project in git, the data stages run (smoke profile) and committed."""
    env = {**live_services, "PATH": f"{VENV_BIN}{os.pathsep}{live_services['PATH']}"}
    project = copy_project(tmp_path_factory.mktemp("origin"))
    shutil.copy(REPO / ".gitignore", project / ".gitignore")
    cmd(["git", "init", "-q"], project, env)
    cmd(["dvc", "init", "-q"], project, env)
    cmd(["dvc", "repro", *DATA_STAGES], project, env)
    git_commit(project, env, "data stages")
    return project, env


def fresh_clone(origin: Path, dest: Path, env: dict[str, str]) -> Path:
    cmd(["git", "clone", "-q", str(origin), str(dest)], dest.parent, env)
    assert not (dest / "data/tokens").exists() and not (dest / ".dvc/cache").exists()
    return dest


def assert_pulled_clone_matches(clone: Path, origin: Path, env: dict[str, str], transcript: list[str]) -> None:
    expected = produced_outputs(origin)
    assert "data/tokens/train/00000-docs.bin" in expected and "data/clean/00000-docs.jsonl" in expected, sorted(
        expected
    )
    assert produced_outputs(clone) == expected
    status = cmd(["dvc", "status", "--with-deps", *DATA_STAGES], clone, env, transcript)
    assert "Data and pipelines are up to date." in status, status


def test_a_local_path_remote_carries_the_outputs_to_a_fresh_clone_byte_identical(origin, tmp_path):
    project, env = origin
    remote = tmp_path / "shared-dvc"  # a path every node mounts
    cmd(["dvc", "remote", "add", "-d", "shared", str(remote)], project, env)
    git_commit(project, env, "remote: shared path")
    cmd(["dvc", "push"], project, env)
    assert any((remote / "files/md5").rglob("*")), "nothing pushed"

    clone = fresh_clone(project, tmp_path / "worker", env)
    cmd(["dvc", "pull", *DATA_STAGES], clone, env)
    assert_pulled_clone_matches(clone, project, env, [])


# --------------------------------------------------------------------------------------------
# S3 through moto, which checks signatures once its first three (set-up) calls are done
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory) -> Iterator[dict[str, str]]:
    """A moto S3 server on loopback with a bucket and an IAM user allowed on S3: its endpoint and
    the user's key pair. Unsigned or wrongly signed requests are refused, as S3 does."""
    pytest.importorskip("dvc_s3", reason="dvc-s3 is not installed (the `cluster` extra)")
    pytest.importorskip("moto.server", reason="moto[server] is not installed (the `cluster` extra)")
    import boto3

    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    server = subprocess.Popen(
        ["timeout", str(MOTO_LIFETIME_S), sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        endpoint = f"http://127.0.0.1:{port}"
        wait_for_port(port, server)
        setup = {"endpoint_url": endpoint, "region_name": "us-east-1"}
        iam = boto3.client("iam", aws_access_key_id="setup", aws_secret_access_key="setup", **setup)
        iam.create_user(UserName="dvc")
        allow_s3 = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="dvc", PolicyName="s3", PolicyDocument=json.dumps(allow_s3))
        key = iam.create_access_key(UserName="dvc")["AccessKey"]
        credentials = {"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}
        boto3.client("s3", **credentials, **setup).create_bucket(Bucket=BUCKET)
        yield {"endpoint": endpoint, "key_id": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def wait_for_port(port: int, server: subprocess.Popen, patience: float = 60.0) -> None:
    deadline = time.monotonic() + patience
    while True:
        assert server.poll() is None, f"moto exited with {server.returncode}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"moto did not listen on {port} within {patience:.0f} s"
            time.sleep(0.2)


def without_aws_credentials(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """No credentials from the caller's environment or ~/.aws, no instance-metadata probes."""
    env = {k: v for k, v in env.items() if not k.startswith("AWS_")}
    return {**env, "HOME": str(tmp_path / "home"), "AWS_EC2_METADATA_DISABLED": "true"}


def test_an_s3_remote_takes_credentials_from_the_environment_or_a_file_outside_git_and_never_shows_the_secret(
    origin, s3_server, tmp_path
):
    project, env = origin
    bare = without_aws_credentials(env, tmp_path)
    transcript: list[str] = []
    for args in (
        ["dvc", "remote", "add", "-d", "s3", f"s3://{BUCKET}/spikelab"],
        ["dvc", "remote", "modify", "s3", "endpointurl", s3_server["endpoint"]],  # S3-compatible storage
        ["dvc", "remote", "modify", "s3", "region", "us-east-1"],
    ):
        cmd(args, project, bare, transcript)
    git_commit(project, bare, "remote: s3")

    # The head node: credentials in the environment.
    head = {**bare, "AWS_ACCESS_KEY_ID": s3_server["key_id"], "AWS_SECRET_ACCESS_KEY": s3_server["secret"]}
    cmd(["dvc", "push"], project, head, transcript)
    assert "in sync" in cmd(["dvc", "status", "--cloud"], project, head, transcript)

    # A worker node: no credentials, refused; then a credentials file outside the clone.
    clone = fresh_clone(project, tmp_path / "worker", bare)
    refused = subprocess.run(
        ["dvc", "pull", WORKER_STAGE], cwd=clone, env=bare, capture_output=True, text=True, timeout=300
    )
    transcript.append(refused.stdout + refused.stderr)
    assert refused.returncode != 0 and not (clone / "data/tokens").exists(), "the bucket must require credentials"
    credentials = tmp_path / "aws" / "credentials"
    credentials.parent.mkdir()
    credentials.touch(mode=0o600)
    credentials.write_text(
        f"[default]\naws_access_key_id = {s3_server['key_id']}\naws_secret_access_key = {s3_server['secret']}\n"
    )
    cmd(["dvc", "remote", "modify", "--local", "s3", "credentialpath", str(credentials)], clone, bare, transcript)

    cmd(["dvc", "pull", WORKER_STAGE], clone, bare, transcript)  # what a worker needs, and only that
    assert (clone / "data/tokens/train/00000-docs.bin").is_file() and not (clone / "data/raw").exists()
    cmd(["dvc", "pull", *DATA_STAGES], clone, bare, transcript)
    assert_pulled_clone_matches(clone, project, bare, transcript)

    secret = s3_server["secret"]
    assert not [i for i, out in enumerate(transcript) if secret in out], "the secret appeared in a command's output"
    for repo in (project, clone):
        assert cmd(["git", "check-ignore", ".dvc/config.local"], repo, bare).strip() == ".dvc/config.local"
        tracked = cmd(["git", "ls-files", "-z"], repo, bare).split("\0")
        assert [f for f in tracked if f and secret.encode() in (repo / f).read_bytes()] == []
        assert secret not in cmd(["git", "log", "--all", "-p"], repo, bare)
