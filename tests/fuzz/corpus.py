"""Valid messages of every kind on plexrl's wire, and the byte format the fuzzers feed decoders:
the starting points of ``decoders.py`` (atheris) and of the fuzz tests."""

from __future__ import annotations

import contextlib

import numpy as np

from plexrl.errors import MessageTooLargeError, PlexError
from plexrl.protocol import calls
from plexrl.protocol import messages as m
from plexrl.protocol.codec import Codec
from plexrl.trace import Span
from plexrl.types import Batch, Ragged, SamplingParams


def messages() -> list[m.Hello | m.OpenJob | m.Submit | m.Cancel | m.StatusRequest | m.Reattach | m.Heartbeat
                        | m.Register | m.CallDone | m.ErrorReply | m.StateMoved | m.Execute | m.MoveState
                        | m.MoveEngines | m.EnginesMoved | m.Shutdown | m.Welcome | m.TraceRequest | m.TraceReply | m.FetchWeights
                        | m.Weights]:  # fmt: skip
    """One real message of every kind (arrays in frames of their own and inline, nested calls)."""
    rows = Ragged.from_rows([np.arange(300) % 60, np.arange(5)], "int32")
    batch = Batch(
        tokens=rows,
        prompt_lens_B=np.array([2, 2], np.int32),
        sampler_logprobs=Ragged.from_rows([-np.ones(298), -np.ones(3)], "float32"),
        advantages_B=np.array([0.5, -0.5], np.float32),
    )
    source = calls.WeightSource("tcp://10.0.0.2:5555", b"k" * 40, "j-1", 2, b"t" * 16, nbytes=16)
    snapshot = calls.Snapshot(step=1, weight_version=1, trainer={"w": np.ones(4, np.float32)}, optimizer=b"\x80")
    messages = [
        m.Hello(rid=1, client_name="c"),
        m.OpenJob(rid=2, name="j", spec=calls.JobSpec(model="/m")),
        m.Submit(rid=3, job_id="j-1", call=calls.Generate(prompts=rows, params=SamplingParams(n=2, seed=1))),
        m.Submit(rid=4, job_id="j-1", call=calls.ForwardBackward(batch=batch)),
        m.Submit(rid=5, job_id="j-1", call=calls.OptimStep()),
        m.Cancel(rid=6, call_rid=3),
        m.StatusRequest(rid=7, min_workers=1),
        m.Reattach(rid=8, name="j"),
        m.Heartbeat(rid=9, worker=b"abcdefgh", progress=3),
        m.Register(rid=10, name="w", device="cpu", engines=["hf"], memory_budget_bytes=1, pid=1),
        m.CallDone(rid=11, job_id="j-1", result=calls.OptimStepResult(step=1, grad_norm=0.1, snapshot=snapshot)),
        m.ErrorReply(rid=12, code="call_failed", message="x"),
        m.StateMoved(rid=13, job_id="j-1", to="host", bytes=1, seconds=0.1),
        m.Execute(rid=14, job_id="j-1", call=calls.Restore(open=calls.Open(spec=calls.JobSpec(model="/m")), snapshot=snapshot)),
        m.MoveState(rid=15, job_id="j-1", to="device"),
        m.Shutdown(rid=16, reason="r", exit=True),
        m.Welcome(rid=17, client_id="c", heartbeat_interval_s=1.0, heartbeat_liveness=5),
        m.TraceRequest(rid=18),
        m.TraceReply(rid=19, spans=[Span("local-0", "j-1", "generate", 1.0, 1.5, queued_s=0.1)], dropped=2),
        m.CallDone(rid=20, job_id="j-1", result=calls.Synced(weight_version=2, source=source, exported_at=1.5)),
        m.Execute(rid=21, job_id="j-1", call=calls.SetWeights(weight_version=2, source=source, exported_at=1.5)),
        m.FetchWeights(rid=22, job_id="j-1", weight_version=2, token=b"t" * 16),
        m.Weights(rid=23, tensors={"w": np.ones(4, np.float32), "big": np.zeros(600, np.float32)}),
        m.MoveEngines(rid=24, to="asleep", level=2),
        m.EnginesMoved(rid=25, to="awake", seconds=0.5, error=""),
    ]  # fmt: skip
    return messages


def seeds() -> list[bytes]:
    """``messages()`` encoded, each as one fuzzer input (see ``frames_of``)."""
    codec: Codec[object] = Codec(m.ToCoordinator)
    return [input_of(codec.encode(msg)) for msg in messages()]


def input_of(frames: list[bytes | memoryview]) -> bytes:
    """Frames (one to four) as one input: a byte with the frame count less one, then each frame's
    4-byte length and bytes."""
    out = bytearray([len(frames) - 1])
    for f in frames:
        b = bytes(f)
        out += len(b).to_bytes(4, "little") + b
    return bytes(out)


def frames_of(data: bytes) -> list[bytes]:
    """The inverse of ``input_of`` on any bytes: short or inconsistent lengths just end the frames."""
    if not data:
        return []
    frames, at = [], 1
    for _ in range(1 + data[0] % 4):
        n = int.from_bytes(data[at : at + 4], "little")
        frames.append(data[at + 4 : at + 4 + n])
        at += 4 + n
    return frames


def mutate(data: bytes, rng: np.random.Generator, edits: int = 4) -> bytes:
    """``data`` with a few random byte edits: overwrites, inserts, deletions."""
    out = bytearray(data)
    for _ in range(edits):
        at = int(rng.integers(0, len(out) + 1))
        match int(rng.integers(0, 3)):
            case 0 if out:
                out[min(at, len(out) - 1)] = int(rng.integers(0, 256))
            case 1:
                out[at:at] = bytes([int(rng.integers(0, 256))])
            case _:
                del out[at : at + 1]
    return bytes(out)


DECODED = (
    m.ToCoordinator,
    m.CoordinatorToWorker,
    m.CoordinatorToClient,
    m.WorkerToWorker,
)  # every union a peer decodes


def decode_or_refuse(frames: list[bytes], codecs: list[Codec[object]]) -> None:
    """What every decoder must do with any frames: return a message that encodes again (the
    coordinator forwards calls and results), or raise a ``PlexError``. Anything else escapes."""
    for codec in codecs:
        try:
            msg = codec.decode(frames)
        except PlexError:
            continue
        with contextlib.suppress(MessageTooLargeError):
            codec.encode(msg)  # type: ignore[arg-type]
