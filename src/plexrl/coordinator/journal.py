"""The coordinator's journal: its recoverable jobs on disk, so a restarted coordinator resumes them.

One SQLite file in WAL mode (``plexrl coordinator --journal PATH``). Per job it holds what the
coordinator keeps to rebuild it after a worker's death (its opening, the snapshot of its last
optimizer step or load, its forward_backward / sync_weights calls since), and the sequence number
and result of its last call that changed its state: the commit point. Each commit is written,
synchronously, before the call's result goes to its client, so whatever a client has seen is on
disk. A restarted coordinator reads the jobs back, rebuilds each on a worker with a ``restore``
(the same path as a worker's death), and tells a reconnecting client which of its calls the job
already holds (``Reattached.committed_seq``).

Rows are plexrl messages (the wire codec: msgpack plus array frames, never pickle), so a journal
written by another protocol version is refused rather than misread.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

from plexrl.protocol import calls
from plexrl.protocol.codec import Codec
from plexrl.protocol.messages import Envelope

Replayed = calls.ForwardBackward | calls.SyncWeights


class JobRow(Envelope, tag="journal_job", frozen=True):
    """A journaled job's identity and commit point (small: rewritten on every commit)."""

    job_id: str
    name: str
    owner: str  # its tenant
    weight: float
    open: calls.Open
    opened: calls.Opened
    committed_seq: int = 0  # its last state-changing call (client order), 0: none yet
    committed: calls.Result | None = None  # that call's result
    weights_seq: int = 0  # its last call that changed what the sampler serves (sync_weights, load)
    next_seq: int = 1  # past the highest call number it was given
    recoveries: int = 0  # times it was rebuilt (its worker lost, or the coordinator restarted)
    token: str = ""  # its OpenJob's token
    generates: int = 0  # its generate calls so far, as of this commit


class SnapshotRow(Envelope, tag="journal_snapshot", frozen=True):
    snapshot: calls.Snapshot


class ReplayRow(Envelope, tag="journal_replay", frozen=True):
    call: Replayed


Row = JobRow | SnapshotRow | ReplayRow
R = TypeVar("R", JobRow, SnapshotRow, ReplayRow)


@dataclass
class JournaledJob:
    """A job as a restarted coordinator finds it."""

    row: JobRow
    snapshot: calls.Snapshot | None = None
    replay: list[Replayed] = field(default_factory=list)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, row BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS snapshots (job_id TEXT PRIMARY KEY, row BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS replay (job_id TEXT NOT NULL, n INTEGER NOT NULL, row BLOB NOT NULL,
                                   PRIMARY KEY (job_id, n));
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


class Journal:
    """``Journal(path)`` opens (or creates) the file; every method commits before it returns."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._db = sqlite3.connect(path, isolation_level=None)  # autocommit; transactions explicit
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a commit is on disk before a client hears of it
        self._db.executescript(_SCHEMA)
        self._codec: Codec[Row] = Codec(Row, max_bytes=1 << 40, copy_arrays=True)

    def close(self) -> None:
        self._db.close()

    # -- reads (at start) -----------------------------------------------------------------------

    def jobs(self) -> list[JournaledJob]:
        found = {}
        for (data,) in self._db.execute("SELECT row FROM jobs ORDER BY job_id"):
            row = self._unpack(data, JobRow)
            found[row.job_id] = JournaledJob(row)
        for job_id, data in self._db.execute("SELECT job_id, row FROM snapshots"):
            if job_id in found:
                found[job_id].snapshot = self._unpack(data, SnapshotRow).snapshot
        for job_id, data in self._db.execute("SELECT job_id, row FROM replay ORDER BY job_id, n"):
            if job_id in found:
                found[job_id].replay.append(self._unpack(data, ReplayRow).call)
        return list(found.values())

    def counter(self, name: str) -> int:
        row = self._db.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()
        return int(row[0]) if row else 0

    # -- writes ---------------------------------------------------------------------------------

    def set_counter(self, name: str, value: int) -> None:
        self._db.execute("INSERT OR REPLACE INTO counters VALUES (?, ?)", (name, value))

    def opened(self, row: JobRow) -> None:
        """A job finished opening: it has no snapshot and nothing to replay yet."""
        with self._transaction():
            self._delete(row.job_id)
            self._db.execute("INSERT INTO jobs VALUES (?, ?)", (row.job_id, self._pack(row)))

    def committed(
        self, row: JobRow, *, snapshot: calls.Snapshot | None = None, replayed: Replayed | None = None, n: int = 0
    ) -> None:
        """A state-changing call of ``row``'s job finished: its new commit point, with the
        snapshot that replaces the job's replay log (optim_step, load) or the call appended to
        that log as its ``n``-th entry (forward_backward, sync_weights)."""
        with self._transaction():
            self._db.execute("UPDATE jobs SET row = ? WHERE job_id = ?", (self._pack(row), row.job_id))
            if snapshot is not None:
                self._db.execute("DELETE FROM replay WHERE job_id = ?", (row.job_id,))
                self._db.execute(
                    "INSERT OR REPLACE INTO snapshots VALUES (?, ?)", (row.job_id, self._pack(SnapshotRow(snapshot=snapshot)))
                )  # fmt: skip
            if replayed is not None:
                self._db.execute(
                    "INSERT OR REPLACE INTO replay VALUES (?, ?, ?)", (row.job_id, n, self._pack(ReplayRow(call=replayed)))
                )  # fmt: skip

    def closed(self, job_id: str) -> None:
        """The job is gone (closed, freed or lost): a restarted coordinator does not resume it."""
        with self._transaction():
            self._delete(job_id)

    # -- helpers --------------------------------------------------------------------------------

    def _delete(self, job_id: str) -> None:
        for table in ("jobs", "snapshots", "replay"):
            self._db.execute(f"DELETE FROM {table} WHERE job_id = ?", (job_id,))

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)

    def _pack(self, row: Row) -> bytes:
        frames = self._codec.encode(row)
        return msgspec.msgpack.encode([bytes(f) for f in frames])

    def _unpack(self, data: bytes, t: type[R]) -> R:
        row = self._codec.decode(msgspec.msgpack.decode(data, type=list[bytes]))
        if not isinstance(row, t):
            raise TypeError(f"journal {self.path}: expected a {t.__name__}, found a {type(row).__name__}")
        return row


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, et: object, e: object, tb: object) -> None:
        self._db.execute("COMMIT" if et is None else "ROLLBACK")
