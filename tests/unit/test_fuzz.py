"""Every decoder on the wire answers any bytes with a message or a typed error: a bounded pass of
the coverage-guided fuzzer (``tests/fuzz/decoders.py``, atheris) and hypothesis properties over
arbitrary bytes and over mutations of real messages of every kind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuzz.corpus import DECODED, decode_or_refuse, frames_of, input_of, messages, mutate, seeds
from plexrl.protocol import messages as m
from plexrl.protocol.codec import Codec

HARNESS = Path(__file__).parents[1] / "fuzz" / "decoders.py"
CODECS: list[Codec[object]] = [Codec(union, max_bytes=1 << 20) for union in DECODED]


def test_the_corpus_holds_every_message_kind_and_decodes() -> None:
    kinds = {type(msg) for msg in messages()}
    assert kinds == {kind for union in DECODED for kind in union.__args__} - {
        m.StatusReply,  # built by the coordinator only; its parts are in Register and Welcome
        m.Reattached,
        m.Registered,
        m.Abort,
    }
    codec: Codec[object] = Codec(m.ToCoordinator)
    for msg, seed in zip(messages(), seeds(), strict=True):
        if isinstance(msg, m.ToCoordinator.__args__):  # type: ignore[attr-defined]
            assert input_of(codec.encode(codec.decode(frames_of(seed)))) == seed  # the same bytes back


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.binary(max_size=512), min_size=0, max_size=3))
def test_arbitrary_frames_decode_or_get_a_typed_error(frames: list[bytes]) -> None:
    decode_or_refuse(frames, CODECS)


@settings(max_examples=3000, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 16))
def test_mutated_messages_of_every_kind_decode_or_get_a_typed_error(seed: int, edits: int) -> None:
    rng = np.random.default_rng(seed)
    corpus = seeds()
    data = mutate(corpus[int(rng.integers(len(corpus)))], rng, edits)
    decode_or_refuse(frames_of(data), CODECS)
    assert frames_of(input_of([data])) == [data]


def test_a_bounded_coverage_guided_fuzz_run_finds_no_crash(tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    done = subprocess.run(
        [sys.executable, str(HARNESS), str(tmp_path), "-runs=200000", "-seed=1"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=HARNESS.parent,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Done 200000 runs" in done.stderr
