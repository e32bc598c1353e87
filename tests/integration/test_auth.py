"""Authentication over real processes: CurveZMQ keys, the ZAP handler and the coordinator's roles.

A coordinator started with ``--keys DIR`` admits only keys on its allowlists and checks each
message against its key's role; one started without keys serves loopback only.
"""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
import zmq.utils.monitor

import plexrl
from plexrl.errors import (
    CallFailedError,
    CheckpointPathError,
    InvalidRequestError,
    NotAuthorizedError,
    NotJobOwnerError,
    TooManyCallsError,
)
from plexrl.protocol import auth, calls
from plexrl.protocol import messages as m
from plexrl.protocol.codec import Codec


async def _plexrl(*args: str, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "plexrl", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=None if env is None else {**os.environ, **env},
    )  # fmt: skip


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    """A coordinator with a key directory of one worker key and one client key (no workers)."""
    keys = tmp_path / "keys"
    cli = await _plexrl("keys", "init", str(keys))
    assert await cli.wait() == 0
    for name, role in (("w0", "worker"), ("alice", "client"), ("bob", "client"), ("root", "admin")):
        cli = await _plexrl("keys", "add", str(keys), name, "--role", role)
        assert await cli.wait() == 0
    coordinator = await _plexrl("coordinator", "--bind", "tcp://127.0.0.1:0", "--print-address", "--keys", str(keys))
    assert coordinator.stdout is not None
    try:
        async with asyncio.timeout(30):
            address = (await coordinator.stdout.readline()).decode().strip()
        assert address.startswith("tcp://"), address
        yield address, keys
    finally:
        coordinator.terminate()
        await coordinator.wait()


def _socket(ctx: zmq.asyncio.Context, creds: auth.Credentials) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    creds.apply(sock)
    return sock


async def _handshake(sock: zmq.asyncio.Socket, address: str) -> int:
    """Connect and wait for the CurveZMQ handshake's outcome: the monitor event that ends it."""
    monitor = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    )
    sock.connect(address)
    try:
        async with asyncio.timeout(30):
            event = zmq.utils.monitor.parse_monitor_message(await monitor.recv_multipart())
        return int(event["event"])
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


REPLIES: Codec[m.Envelope] = Codec(m.CoordinatorToClient | m.CoordinatorToWorker)  # type: ignore[arg-type]


async def _ask(sock: zmq.asyncio.Socket, msg: m.Envelope) -> m.Envelope:
    await sock.send_multipart(REPLIES.encode(msg))
    async with asyncio.timeout(30):
        return REPLIES.decode(await sock.recv_multipart(copy=False))


def test_keys_are_written_owner_only(tmp_path: Path) -> None:
    auth.init_dir(tmp_path / "k")
    secret = auth.add_key(tmp_path / "k", "bob", "client")
    for path in (secret, tmp_path / "k" / "coordinator.key_secret"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert (tmp_path / "k" / "clients" / "bob.key").exists()
    secret.chmod(0o644)
    with pytest.raises(plexrl.errors.InvalidRequestError, match="chmod 600"):
        auth.load_pair(secret)


async def test_a_key_not_on_the_allowlist_is_refused_at_the_handshake(
    secured: tuple[str, Path], tmp_path: Path
) -> None:
    address, keys = secured
    rogue = auth.write_pair(tmp_path / "rogue.key_secret", tmp_path / "rogue.key")
    ctx = zmq.asyncio.Context()
    try:
        sock = _socket(ctx, auth.Credentials(rogue, auth.load_public(keys / "coordinator.key")))
        assert await _handshake(sock, address) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        sock.close()
        member = _socket(ctx, auth.Credentials.load(keys / "secret" / "w0.key_secret", keys / "coordinator.key"))
        assert await _handshake(member, address) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        member.close()
    finally:
        ctx.term()


async def test_a_client_key_cannot_register_a_worker_nor_a_worker_key_open_a_session(
    secured: tuple[str, Path],
) -> None:
    address, keys = secured
    coordinator_key = keys / "coordinator.key"
    register = m.Register(rid=1, name="impostor", device="cpu", engines=["hf"], memory_budget_bytes=1, pid=1)
    ctx = zmq.asyncio.Context()
    try:
        client = _socket(ctx, auth.Credentials.load(keys / "secret" / "alice.key_secret", coordinator_key))
        client.connect(address)
        reply = await _ask(client, register)
        assert isinstance(reply, m.ErrorReply) and reply.code == NotAuthorizedError.code, reply
        assert "worker key" in reply.message
        assert isinstance(await _ask(client, m.Hello(rid=2)), m.Welcome)  # what a client key is for
        worker = _socket(ctx, auth.Credentials.load(keys / "secret" / "w0.key_secret", coordinator_key))
        worker.connect(address)
        reply = await _ask(worker, m.Hello(rid=3))
        assert isinstance(reply, m.ErrorReply) and reply.code == NotAuthorizedError.code, reply
        assert isinstance(await _ask(worker, register), m.Registered)
        client.close()
        worker.close()
    finally:
        ctx.term()


async def test_workers_and_clients_with_keys_run_a_job(secured: tuple[str, Path], tiny_model: Path) -> None:
    address, keys = secured
    worker = await _plexrl(
        "worker", "--coordinator", address, "--name", "keyed", "--sampler", "hf",
        "--key", str(keys / "secret" / "w0.key_secret"), "--coordinator-key", str(keys / "coordinator.key"),
    )  # fmt: skip
    try:
        creds = auth.Credentials.load(keys / "secret" / "alice.key_secret", keys / "coordinator.key")
        async with asyncio.timeout(120), plexrl.connect(address, credentials=creds) as client:
            assert [w.name for w in (await client.status(min_workers=1)).workers] == ["keyed"]
            async with plexrl.job("keyed-job", model=tiny_model) as job:
                out = await job.generate([[1, 5, 6]], plexrl.SamplingParams(max_tokens=4, temperature=0.0))
                assert len(out.samples) == 1
    finally:
        worker.terminate()
        await worker.wait()


async def test_a_tenant_sees_and_uses_only_its_own_jobs(
    secured: tuple[str, Path], tiny_model: Path, tmp_path: Path
) -> None:
    # Jobs belong to keys, not connections: a second connection of alice's key may call her job;
    # bob's key may not, and sees it in status without its name; the admin key sees everything.
    # Checkpoints go to each tenant's folder: bob can neither load alice's nor reach it by path.
    address, keys = secured
    worker = await _plexrl(
        "worker", "--coordinator", address, "--name", "shared", "--sampler", "hf",
        "--key", str(keys / "secret" / "w0.key_secret"), "--coordinator-key", str(keys / "coordinator.key"),
        "--checkpoint-root", str(tmp_path / "ckpt"),
    )  # fmt: skip

    def creds(name: str) -> auth.Credentials:
        return auth.Credentials.load(keys / "secret" / f"{name}.key_secret", keys / "coordinator.key")

    try:
        async with asyncio.timeout(120), plexrl.connect(address, credentials=creds("alice")) as alice:
            await alice.status(min_workers=1)
            async with plexrl.job("alices-job", model=tiny_model) as job:
                async with plexrl.connect(address, credentials=creds("alice")) as again:
                    synced = await again.submit(job.job_id, calls.SyncWeights(), calls.Synced)
                    assert synced.weight_version == 1
                async with plexrl.connect(address, credentials=creds("bob")) as bob:
                    with pytest.raises(NotJobOwnerError, match="another tenant"):
                        await bob.submit(job.job_id, calls.SyncWeights(), calls.Synced)
                    theirs = (await bob.status()).jobs
                    assert [(j.job_id, j.name, j.owner, j.state) for j in theirs] == [("", "", "", "open")]
                    assert (await bob.status()).workers[0].jobs == [""]
                async with plexrl.connect(address, credentials=creds("root")) as root:
                    seen = (await root.status()).jobs
                    assert [(j.job_id, j.name, j.owner) for j in seen] == [(job.job_id, "alices-job", "alice")]
                mine = (await alice.status()).jobs
                assert [(j.job_id, j.owner) for j in mine] == [(job.job_id, "alice")]
                saved = await job.save("step-1")
                assert Path(saved.path) == (tmp_path / "ckpt" / "alice" / "step-1").resolve()
                exported = await job.export("adapter-1", format="peft")  # confined like a checkpoint
                assert Path(exported.path) == (tmp_path / "ckpt" / "alice" / "adapter-1").resolve()
                assert (Path(exported.path) / "adapter_config.json").is_file()
                with pytest.raises(CheckpointPathError):
                    await job.export("../bob/adapter", format="hf")
                with pytest.raises(InvalidRequestError, match="export format 'onnx'"):
                    job.export("x", format="onnx")
                async with (
                    plexrl.connect(address, credentials=creds("bob")),
                    plexrl.job("bobs-job", model=tiny_model) as theirs_job,
                ):
                    with pytest.raises(CallFailedError):
                        await theirs_job.load("step-1")  # bob's own folder has none
                    with pytest.raises(CheckpointPathError):
                        await theirs_job.load("../alice/step-1")
                    with pytest.raises(CheckpointPathError):
                        await theirs_job.load(saved.path)
                assert (await job.load("step-1")).weight_version == 1
    finally:
        worker.terminate()
        await worker.wait()


async def test_without_keys_the_coordinator_serves_loopback_only() -> None:
    refused = await _plexrl("coordinator", "--bind", "tcp://0.0.0.0:0", "--insecure")
    async with asyncio.timeout(30):
        _, err = await refused.communicate()
    assert refused.returncode != 0
    assert b"--keys" in err and b"loopback" in err
    missing = await _plexrl("coordinator", "--bind", "tcp://127.0.0.1:0")
    async with asyncio.timeout(30):
        _, err = await missing.communicate()
    assert missing.returncode != 0
    assert b"--keys DIR" in err and b"--insecure" in err


@pytest.mark.parametrize("limit", ["calls", "bytes"])
async def test_a_tenant_past_its_limits_gets_a_typed_error_and_keeps_its_job(tiny_model: Path, limit: str) -> None:
    # calls: 2 at once, so a third (behind a long generate and a sync) is refused; bytes: 300 kB,
    # so a second 240 kB logprobs call is refused while the first waits.
    flag = ["--max-calls-per-tenant", "2"] if limit == "calls" else ["--max-bytes-per-tenant", "300kB"]
    coordinator = await _plexrl("coordinator", "--bind", "tcp://127.0.0.1:0", "--print-address", "--insecure", *flag)
    assert coordinator.stdout is not None
    worker = None
    rows = [[1, *([5] * 999)]] * 60  # 60 x 1000 int32 tokens: 240 kB
    try:
        async with asyncio.timeout(120):
            address = (await coordinator.stdout.readline()).decode().strip()
            worker = await _plexrl("worker", "--coordinator", address, "--sampler", "hf")
            async with plexrl.connect(address, credentials=None) as client:
                await client.status(min_workers=1)
                async with plexrl.job("busy", model=tiny_model) as job:
                    running = job.generate([[1, 5, 6]] * 32, plexrl.SamplingParams(n=4, max_tokens=128))
                    queued = job.sync_weights() if limit == "calls" else job.logprobs(rows)
                    with pytest.raises(TooManyCallsError, match=f"max-{limit}-per-tenant"):
                        await (job.sync_weights() if limit == "calls" else job.logprobs(rows))
                    assert len((await running).samples) == 128
                    await queued
                    assert (await job.sync_weights()).weight_version == (2 if limit == "calls" else 1)
    finally:
        for proc in (worker, coordinator):
            if proc is not None:
                proc.terminate()
                await proc.wait()
