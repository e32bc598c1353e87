"""Framing and decoding: round trips are exact, and every kind of bad frame is a typed error."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from plexrl.errors import MalformedMessageError, MessageTooLargeError, ProtocolVersionError
from plexrl.protocol import calls
from plexrl.protocol import messages as m
from plexrl.protocol.codec import Codec, rid_of
from plexrl.types import Batch, Ragged, SamplingParams


def _batch(rows: int = 2, length: int = 300) -> Batch:
    rng = np.random.default_rng(0)
    prompt = length // 3
    return Batch(
        tokens=Ragged.from_rows([rng.integers(0, 60, length) for _ in range(rows)], "int32"),
        prompt_lens_B=np.full(rows, prompt, np.int32),
        sampler_logprobs=Ragged.from_rows([-rng.random(length - prompt) for _ in range(rows)], "float32"),
        advantages_B=rng.standard_normal(rows).astype(np.float32),
    )


def test_large_arrays_travel_as_their_own_frames_and_round_trip_exactly() -> None:
    codec: Codec[m.ToCoordinator] = Codec(m.ToCoordinator)
    msg = m.Submit(rid=7, job_id="j-1", call=calls.ForwardBackward(batch=_batch(), loss="grpo"))
    frames = codec.encode(msg)
    assert len(frames) == 1 + 2  # body + tokens.values + sampler_logprobs.values; the rest is small
    back = codec.decode(frames)
    assert isinstance(back, m.Submit) and back.rid == 7 and isinstance(back.call, calls.ForwardBackward)
    for a, b in [
        (back.call.batch.tokens.values, msg.call.batch.tokens.values),
        (back.call.batch.prompt_lens_B, msg.call.batch.prompt_lens_B),
        (back.call.batch.advantages_B, msg.call.batch.advantages_B),
    ]:
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_small_arrays_travel_inside_the_body() -> None:
    codec: Codec[m.ToCoordinator] = Codec(m.ToCoordinator)
    msg = m.Submit(job_id="j", call=calls.ForwardBackward(batch=_batch(rows=2, length=4), loss="grpo"))
    frames = codec.encode(msg)
    assert len(frames) == 1
    back = codec.decode(frames)
    assert isinstance(back, m.Submit) and isinstance(back.call, calls.ForwardBackward)
    assert np.array_equal(back.call.batch.tokens.values, msg.call.batch.tokens.values)


def test_decoded_arrays_share_the_received_frames_unless_a_copy_is_asked_for() -> None:
    msg = m.Submit(job_id="j", call=calls.Logprobs(tokens=Ragged.from_rows([np.arange(1000)], "int32")))
    frames = Codec(m.ToCoordinator).encode(msg)
    shared = Codec(m.ToCoordinator).decode(frames)
    copied = Codec(m.ToCoordinator, copy_arrays=True).decode(frames)
    assert isinstance(shared, m.Submit) and isinstance(copied, m.Submit)
    assert isinstance(shared.call, calls.Logprobs) and isinstance(copied.call, calls.Logprobs)
    assert np.shares_memory(shared.call.tokens.values, msg.call.tokens.values)  # zero-copy
    assert not np.shares_memory(copied.call.tokens.values, msg.call.tokens.values)


def test_garbage_is_a_malformed_message() -> None:
    with pytest.raises(MalformedMessageError):
        Codec(m.ToCoordinator).decode([b"\x00\xffnot msgpack"])


def test_an_unknown_message_type_is_malformed_and_keeps_its_request_id() -> None:
    body = msgspec.msgpack.encode({"type": "launch_missiles", "v": 1, "rid": 42})
    with pytest.raises(MalformedMessageError) as info:
        Codec(m.ToCoordinator).decode([body])
    assert rid_of(info.value) == 42


def test_a_different_protocol_version_is_rejected_before_decoding() -> None:
    body = msgspec.msgpack.encode({"type": "hello", "v": 99, "rid": 3, "future_field": [1, 2]})
    with pytest.raises(ProtocolVersionError, match="v99") as info:
        Codec(m.ToCoordinator).decode([body])
    assert rid_of(info.value) == 3


@pytest.mark.parametrize(
    "ref",
    [
        ["<i4", [3], 5],  # frame that does not exist
        ["<i4", [4], 0],  # shape larger than the frame
        ["|O", [1], 0],  # object dtype: never
        ["<i4", [-1], 0],  # negative shape
        ["<i4", [2], b"\x00\x00\x00\x00"],  # inline bytes that do not match the shape
    ],
)
def test_bad_array_references_are_malformed(ref: list) -> None:
    body = msgspec.msgpack.encode(
        {
            "type": "submit",
            "v": 1,
            "rid": 1,
            "job_id": "j",
            "call": {"type": "logprobs", "tokens": {"values": ref, "offsets": ["<i8", [2], 0]}},
        }
    )
    with pytest.raises(MalformedMessageError):
        Codec(m.ToCoordinator).decode([body, np.arange(3, dtype=np.int32).tobytes()])


def test_messages_over_the_limit_are_refused_on_both_ends() -> None:
    big = m.Submit(job_id="j", call=calls.Logprobs(tokens=Ragged.from_rows([np.zeros(4096)], "int32")))
    with pytest.raises(MessageTooLargeError, match="split"):
        Codec(m.ToCoordinator, max_bytes=1024).encode(big)
    frames = Codec(m.ToCoordinator).encode(big)
    with pytest.raises(MessageTooLargeError):
        Codec(m.ToCoordinator, max_bytes=1024).decode(frames)


def test_generated_results_group_samples_by_prompt() -> None:
    gen = calls.Generated(
        tokens=Ragged.from_rows([[5], [6, 2], [7]], "int32"),
        logprobs=Ragged.from_rows([[-1.0], [-1.0, -0.5], [-2.0]], "float32"),
        prompt_index_B=np.array([0, 0, 1], np.int32),
        finish_reasons=["length", "stop", "length"],
        weight_version=3,
    )
    groups = gen.groups()
    assert [len(g) for g in groups] == [2, 1]
    assert groups[0][1].tokens.tolist() == [6, 2] and groups[0][1].finish_reason == "stop"
    assert all(s.weight_version == 3 for s in gen.samples)
    batch = Batch.from_samples([[1, 9], [1]], gen.samples, advantages=[0.5, -0.5, 0.0])
    batch.validate("grpo")
    assert batch.tokens[1].tolist() == [1, 9, 6, 2] and batch.prompt_lens_B.tolist() == [2, 2, 1]


def test_sampling_params_travel_inside_generate() -> None:
    codec: Codec[m.ToCoordinator] = Codec(m.ToCoordinator)
    sp = SamplingParams(n=4, max_tokens=8, temperature=0.7, stop_token_ids=(2, 3))
    back = codec.decode(
        codec.encode(m.Submit(job_id="j", call=calls.Generate(prompts=Ragged.from_rows([[1]], "int32"), params=sp)))
    )
    assert isinstance(back, m.Submit) and isinstance(back.call, calls.Generate) and back.call.params == sp
