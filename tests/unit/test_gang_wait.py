"""How the book answers a call sent to every member of a gang (``records.GangWait``)."""

from __future__ import annotations

from plexrl.coordinator.records import GangWait
from plexrl.errors import CallFailedError, GangBrokenError
from plexrl.protocol import calls
from plexrl.protocol import messages as m


def done(rid: int) -> m.CallDone:
    return m.CallDone(rid=rid, job_id="j", result=calls.Closed())


def failed(code: str) -> m.ErrorReply:
    return m.ErrorReply(rid=1, code=code, message=code)


def test_the_call_is_answered_once_every_member_has_and_by_the_leader() -> None:
    wait = GangWait(("w0", "w1"))
    wait.replies["w1"] = done(2)
    assert wait.answer() is None
    wait.replies["w0"] = done(1)
    assert wait.answer() == done(1)


def test_a_broken_gang_wins_over_a_failure_so_its_state_is_rebuilt() -> None:
    wait = GangWait(("w0", "w1"))
    wait.replies["w0"] = failed(CallFailedError.code)
    wait.replies["w1"] = failed(GangBrokenError.code)
    assert wait.answer() == failed(GangBrokenError.code)
    wait.replies["w1"] = done(2)
    assert wait.answer() == failed(CallFailedError.code)
