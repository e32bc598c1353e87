"""Coverage-guided fuzzing (atheris) of every decoder on plexrl's wire: what the coordinator reads
from clients and workers, what a worker reads from the coordinator, what a client reads from it.

    python tests/fuzz/decoders.py [CORPUS_DIR] [libFuzzer flags, e.g. -runs=100000 -max_total_time=600]

The fuzzer's bytes become one to four frames (a body and array frames, as a ZeroMQ message
arrives); each decoder must return a message of its union or raise a ``PlexError``, and nothing
else, whatever the bytes (an uncaught exception is a crash the fuzzer reports with its input).
Whatever decodes must encode again (the coordinator forwards calls and results). The corpus
starts from real encoded messages of every kind (``corpus.py``), so the fuzzer mutates from valid
schemas inward. ``tests/unit/test_fuzz.py`` runs a bounded pass of this in the test suite.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from plexrl.protocol.codec import Codec

from corpus import DECODED, decode_or_refuse, frames_of, seeds  # the same directory

CODECS: list[Codec[object]] = [Codec(union, max_bytes=1 << 20) for union in DECODED]


def one_input(data: bytes) -> None:
    decode_or_refuse(frames_of(data), CODECS)


def main() -> None:
    """libFuzzer's flags pass through; a directory argument is the corpus (the seeds are written
    into it, and what the fuzzer finds interesting is kept there), else a temporary one."""
    import os
    import tempfile

    dirs = [a for a in sys.argv[1:] if not a.startswith("-")]
    corpus = dirs[0] if dirs else tempfile.mkdtemp(prefix="plexrl-fuzz-")
    for i, seed in enumerate(seeds()):
        with open(os.path.join(corpus, f"seed-{i}"), "wb") as f:
            f.write(seed)
    atheris.Setup([a for a in sys.argv if a not in dirs] + [corpus], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
