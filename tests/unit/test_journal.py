"""The coordinator's journal: what it commits is what a restarted coordinator reads back."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgspec
import numpy as np
import pytest

from plexrl.coordinator.journal import JobRow, Journal
from plexrl.errors import ProtocolVersionError
from plexrl.protocol import calls
from plexrl.types import Batch, Ragged


def _row(job_id: str = "j-1", **changes: object) -> JobRow:
    spec = calls.JobSpec(model="tiny", seed=3)
    opened = calls.Opened(weight_version=0, trainable_params=10, total_params=100, state_bytes=4096, snapshots=True)
    row = JobRow(job_id=job_id, name="j", owner="alice", weight=2.0, open=calls.Open(spec=spec), opened=opened)
    return msgspec.structs.replace(row, **changes)


def _snapshot(step: int) -> calls.Snapshot:
    weights = {"a": np.arange(600, dtype=np.float32) * step, "b": np.ones(3, np.float32)}  # one framed, one inline
    return calls.Snapshot(step=step, weight_version=step, trainer=weights, optimizer=b"\x00adam" * step)


def _fb(n: int) -> calls.ForwardBackward:
    tokens = Ragged.from_rows([[1, 2, 3, n]], "int32")
    batch = Batch(tokens=tokens, prompt_lens_B=np.array([2], np.int32), advantages_B=np.array([0.5], np.float32))
    return calls.ForwardBackward(batch=batch)


def test_commits_are_read_back_and_a_snapshot_replaces_the_replay_log(tmp_path: Path) -> None:
    path = str(tmp_path / "journal.sqlite")
    journal = Journal(path)
    journal.opened(_row())
    journal.opened(_row("k-2"))
    journal.committed(_row(committed_seq=2, committed=calls.ForwardBackwardResult(loss=1.5, num_tokens=3)),
                      replayed=_fb(1), n=1)  # fmt: skip
    journal.committed(_row(committed_seq=3, committed=calls.OptimStepResult(step=1, grad_norm=0.25)),
                      snapshot=_snapshot(1))  # fmt: skip
    journal.committed(_row(committed_seq=5), replayed=_fb(2), n=1)
    journal.committed(_row(committed_seq=6, weights_seq=6), replayed=calls.SyncWeights(), n=2)
    journal.closed("k-2")
    journal.set_counter("next_job", 3)
    journal.close()

    again = Journal(path)  # what a restarted coordinator finds
    (found,) = again.jobs()
    assert found.row == _row(committed_seq=6, weights_seq=6)
    assert found.snapshot is not None and found.snapshot.step == 1 and found.snapshot.optimizer == b"\x00adam"
    np.testing.assert_array_equal(found.snapshot.trainer["a"], np.arange(600, dtype=np.float32))
    assert [type(c) for c in found.replay] == [calls.ForwardBackward, calls.SyncWeights]  # since the snapshot
    fb = found.replay[0]
    assert isinstance(fb, calls.ForwardBackward) and fb.batch.tokens.values.tolist() == [1, 2, 3, 2]
    assert again.counter("next_job") == 3 and again.counter("other") == 0


def test_a_commit_that_fails_part_way_leaves_the_one_before_whole(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path / "journal.sqlite"))
    journal.opened(_row())
    journal.committed(_row(committed_seq=1), snapshot=_snapshot(1))
    journal._db.execute("DROP TABLE replay")  # the commit's second write fails, after its first
    with pytest.raises(sqlite3.OperationalError):
        journal.committed(_row(committed_seq=2), replayed=_fb(1), n=1)
    (data,) = journal._db.execute("SELECT row FROM jobs").fetchone()
    assert journal._unpack(data, JobRow).committed_seq == 1  # the job row's update rolled back with it


def test_a_journal_of_another_protocol_version_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "journal.sqlite")
    journal = Journal(path)
    journal.opened(_row())
    data = journal._db.execute("SELECT row FROM jobs").fetchone()[0]
    frames = msgspec.msgpack.decode(data, type=list[bytes])
    body = msgspec.msgpack.decode(frames[0])
    body["v"] = 99
    frames[0] = msgspec.msgpack.encode(body)
    journal._db.execute("UPDATE jobs SET row = ?", (msgspec.msgpack.encode(frames),))
    journal._db.commit()
    with pytest.raises(ProtocolVersionError):
        journal.jobs()
