"""A worker's replies belong to the coordinator session their calls came in."""

from __future__ import annotations

from plexrl.worker.server import Worker, WorkerConfig


class _Socket:
    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes], copy: bool = True) -> None:
        self.sent.append(frames)


def test_a_background_calls_reply_from_a_lost_coordinator_session_is_dropped_not_sent_to_the_next() -> None:
    # Found by bench/chaos.py: the coordinator was killed while vLLM generates ran; closing the
    # engine aborted them, and their CallAbortedError replies, sent after the worker registered
    # with the restarted coordinator, failed that coordinator's calls of the same ids.
    worker = Worker(WorkerConfig(coordinator="tcp://127.0.0.1:9"))
    worker._session_no = 1
    worker._later(lambda: [b"aborted call 7 of the lost coordinator"], session=1)
    worker._session_no = 2  # the coordinator was lost; the worker registered again
    worker._later(lambda: [b"call 7 of the new coordinator done"], session=2)
    sock = _Socket()
    worker._send_finished(sock)  # type: ignore[arg-type]
    assert sock.sent == [[b"call 7 of the new coordinator done"]]
