"""Bad input gets a typed error (or is dropped when no reply is possible), and the coordinator
keeps serving everyone else. A raw DEALER socket plays the misbehaving client."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

import plexrl
from fuzz.corpus import frames_of, mutate, seeds
from plexrl.client.connection import Client
from plexrl.errors import (
    BatchShapeError,
    InvalidSamplingParamsError,
    JobTooLargeError,
    ModelNotFoundError,
    UnknownJobError,
)
from plexrl.models import QWEN3_CONFIGS
from plexrl.protocol import auth, calls
from plexrl.protocol import messages as m
from plexrl.protocol.codec import Codec
from plexrl.types import Batch, Ragged, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

LIMIT = 1 << 20  # the cluster's message size limit for this module


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def embedded(tiny_model: Path) -> AsyncIterator[plexrl.LocalCluster]:
    local = plexrl.local(workers=1, heartbeat_interval_s=0.5, max_message_bytes=LIMIT)
    async with local:
        yield local


RAW_KEYS = itertools.count()


@contextlib.contextmanager
def _new_tenant(embedded: plexrl.LocalCluster, cluster: Client) -> Iterator[zmq.asyncio.Socket]:
    """A raw connection with a client key issued to the running cluster just now."""
    assert embedded.keys is not None
    key = auth.add_key(embedded.keys, f"raw-{next(RAW_KEYS)}", "client")
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    auth.Credentials.load(key, embedded.keys / "coordinator.key").apply(sock)
    sock.connect(cluster.address)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


@pytest_asyncio.fixture(loop_scope="module")
async def raw(embedded: plexrl.LocalCluster, cluster: Client) -> AsyncIterator[zmq.asyncio.Socket]:
    """A tenant of its own that said Hello."""
    with _new_tenant(embedded, cluster) as sock:
        _send(sock, m.Hello(rid=1))
        assert isinstance(await _reply(sock), m.Welcome)
        yield sock


async def _reply(sock: zmq.asyncio.Socket, timeout_s: float = 10.0) -> m.CoordinatorToClient | None:
    try:
        frames = await asyncio.wait_for(sock.recv_multipart(), timeout_s)
    except TimeoutError:
        return None
    return Codec(m.CoordinatorToClient).decode(frames)


def _send(sock: zmq.asyncio.Socket, msg: msgspec.Struct) -> None:
    sock.send_multipart(Codec(m.ToCoordinator, max_bytes=1 << 30).encode(msg))


async def _still_serving(cluster: Client) -> None:
    status = await cluster.status()
    assert len(status.workers) == 1


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([b"\xc1garbage"], "malformed_message"),
        ([msgspec.msgpack.encode({"type": "hello", "v": 99, "rid": 5})], "protocol_version"),
        ([msgspec.msgpack.encode({"type": "no_such_message", "v": 1, "rid": 6})], "malformed_message"),
        ([msgspec.msgpack.encode({"type": "submit", "v": 1, "rid": 7, "job_id": 3})], "malformed_message"),
    ],
)
async def test_undecodable_messages_get_a_typed_error(
    cluster: Client, raw: zmq.asyncio.Socket, frames: list[bytes], code: str
) -> None:
    raw.send_multipart(frames)
    reply = await _reply(raw)
    assert isinstance(reply, m.ErrorReply) and reply.code == code
    await _still_serving(cluster)


async def test_a_stream_of_mutated_messages_of_every_kind_never_stops_the_coordinator(
    cluster: Client, raw: zmq.asyncio.Socket
) -> None:
    """The wire fuzzer's corpus (tests/fuzz), mutated: whatever reaches the coordinator gets a
    typed error or is dropped, and everyone else is served throughout."""
    rng = np.random.default_rng(0)
    corpus = seeds()
    for i in range(3000):
        raw.send_multipart(frames_of(mutate(corpus[i % len(corpus)], rng, edits=1 + i % 8)))
        if i % 500 == 0:
            await _still_serving(cluster)
    await _still_serving(cluster)
    errors = 0
    while (reply := await _reply(raw, timeout_s=1.0)) is not None:
        errors += isinstance(reply, m.ErrorReply)
    assert errors > 0  # the bad ones were answered, not silently eaten


async def test_an_oversized_message_gets_an_error_and_a_huge_one_is_dropped(
    cluster: Client, raw: zmq.asyncio.Socket
) -> None:
    over = np.zeros(LIMIT // 4 + 16, np.int32)  # a little over the limit
    _send(raw, m.Submit(rid=8, job_id="x", call=calls.Logprobs(tokens=Ragged.from_rows([over], "int32"))))
    reply = await _reply(raw)
    assert isinstance(reply, m.ErrorReply) and reply.code == "message_too_large" and reply.rid == 8
    huge = np.zeros(3 * LIMIT // 4, np.int32)  # over the hard cap: the peer is cut off, no reply
    _send(raw, m.Submit(rid=9, job_id="x", call=calls.Logprobs(tokens=Ragged.from_rows([huge], "int32"))))
    assert await _reply(raw, timeout_s=1.5) is None
    await _still_serving(cluster)


async def test_a_connection_that_did_not_say_hello_is_told_to(embedded: plexrl.LocalCluster, cluster: Client) -> None:
    """What a client hears from a coordinator that restarted (or declared it gone): it says Hello
    again and reattaches its jobs (tests/integration/test_coordinator_restart.py)."""
    with _new_tenant(embedded, cluster) as sock:
        _send(sock, m.StatusRequest(rid=3))
        reply = await _reply(sock)
        assert isinstance(reply, m.ErrorReply) and reply.code == "unknown_client" and reply.rid == 3
        _send(sock, m.Heartbeat())
        beat = await _reply(sock)
        assert isinstance(beat, m.Heartbeat) and not beat.known
        _send(sock, m.Hello(rid=4))
        assert isinstance(await _reply(sock), m.Welcome)
        _send(sock, m.Heartbeat())
        beat = await _reply(sock)
        assert isinstance(beat, m.Heartbeat) and beat.known


async def test_calls_on_unknown_or_foreign_jobs_are_refused(
    cluster: Client, raw: zmq.asyncio.Socket, tiny_model: Path
) -> None:
    _send(raw, m.Submit(rid=10, job_id="nope-1", call=calls.SyncWeights()))
    reply = await _reply(raw)
    assert isinstance(reply, m.ErrorReply) and reply.code == "unknown_job"
    async with plexrl.job("mine", model=tiny_model) as job:
        _send(raw, m.Submit(rid=11, job_id=job.job_id, call=calls.SyncWeights()))
        reply = await _reply(raw)
        assert isinstance(reply, m.ErrorReply) and reply.code == "not_job_owner"
        assert (await job.sync_weights()).weight_version == 1  # the owner's job was untouched
    with pytest.raises(UnknownJobError):
        await cluster.submit("nope-2", calls.SyncWeights(), calls.Synced)


async def test_invalid_calls_are_refused_before_they_reach_a_worker(
    cluster: Client, raw: zmq.asyncio.Socket, tiny_model: Path
) -> None:
    async with plexrl.job("strict", model=tiny_model) as job:
        with pytest.raises(InvalidSamplingParamsError, match="top_p"):
            job.generate([[1, 2]], SamplingParams(top_p=2.0))
        bad = Batch(tokens=Ragged.from_rows([[1, 2, 3]], "int32"), prompt_lens_B=np.array([1, 1], np.int32))
        with pytest.raises(BatchShapeError, match="prompt_lens_B"):
            job.forward_backward(bad, loss="cross_entropy")
        # The same kind of bad call sent raw is refused by the coordinator with the same typed error.
        _send(raw, m.OpenJob(rid=12, name="raw", spec=calls.JobSpec(model=str(tiny_model))))
        opened = await _reply(raw)
        assert isinstance(opened, m.CallDone) and isinstance(opened.result, calls.Opened)
        bad_params = {
            "type": "generate",
            "prompts": {"values": ["<i4", [1], 0], "offsets": ["<i8", [2], 1]},
            "params": {"n": 0},
        }
        body = msgspec.msgpack.encode(
            {"type": "submit", "v": 1, "rid": 13, "job_id": opened.job_id, "call": bad_params}
        )
        raw.send_multipart([body, np.array([1], np.int32).tobytes(), np.array([0, 1], np.int64).tobytes()])
        reply = await _reply(raw)
        assert isinstance(reply, m.ErrorReply) and reply.code == "invalid_sampling_params" and reply.rid == 13
        # Only a generate continues a trajectory; a placement must be one there is.
        turn = m.TurnOf(trajectory="t0", turn=1)
        _send(raw, m.Submit(rid=14, job_id=opened.job_id, call=calls.SyncWeights(), turn=turn))
        reply = await _reply(raw)
        assert isinstance(reply, m.ErrorReply) and reply.code == "invalid_request" and "turn" in reply.message
        _send(raw, m.OpenJob(rid=15, name="nowhere", spec=calls.JobSpec(model=str(tiny_model)), placement="pool"))
        reply = await _reply(raw)
        assert isinstance(reply, m.ErrorReply) and reply.code == "invalid_request" and "pooled" in reply.message
        # Token ids outside the vocabulary are caught by the worker.
        with pytest.raises(BatchShapeError):
            await job.generate([[1, 10_000]])
        assert (await job.generate([[1, 2]], SamplingParams(max_tokens=2))).weight_version == 0


async def test_an_unknown_model_path_is_a_typed_error(cluster: Client, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="nothing-here"):
        async with plexrl.job("ghost", model=tmp_path / "nothing-here"):
            pass
    await _still_serving(cluster)


async def test_a_job_too_large_for_every_worker_is_refused_at_open_with_the_plans_numbers(
    cluster: Client, tmp_path: Path
) -> None:
    # Qwen3-8B's config.json alone: the client sizes the job from it, and the coordinator refuses a
    # full fine-tune (16 bytes a parameter of state) before any worker loads anything.
    model = tmp_path / "qwen3-8b-config-only"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_CONFIGS["8B"]))
    with pytest.raises(
        JobTooLargeError,
        match=r"fits no worker: on w\d+ \(cpu, .* it needs \d+ GiB \(trained state \d+ GiB, base weights",
    ):
        async with plexrl.job("huge", model=model, lora=None):
            pass
    status = await cluster.status()
    assert not [j for j in status.jobs if j.name == "huge"]  # nothing of it is left
    await _still_serving(cluster)
