"""Jobs on worker groups (several devices: an FSDP trainer, a tensor-parallel sampler): aligned
placement, gang dispatch, residency per member, failures as a unit; in the scheduler and the
simulator, and their cost model."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexrl.coordinator.events import (
    CallFinished,
    CallSubmitted,
    Dispatch,
    Fail,
    GangBroken,
    JobLost,
    JobOpened,
    JobSized,
    OwnCall,
    Place,
    Recover,
    Swap,
    SwapDone,
    WorkerJoined,
    WorkerLost,
)
from plexrl.coordinator.scheduler import Scheduler
from plexrl.errors import GangBrokenError, NoWorkersError, WorkerLostError
from plexrl.sim import JobModel, Lognormal, SimResult, Simulation
from plexrl.sim.costs import H200, MICROBATCH_TOKENS, QWEN3, group_costs, group_job, ring_s


def _cluster(policy: str, workers: int, memory_bytes: float = math.inf, node_devices: int = 8) -> Scheduler:
    s = Scheduler(policy)
    for i in range(workers):
        node, index = divmod(i, node_devices)
        s.handle(WorkerJoined(f"w{i}", memory_bytes=memory_bytes, node=f"n{node}", index=index), 0.0)
    return s


def _index(worker_id: str) -> int:
    return int(worker_id[1:])


# -- placement: aligned blocks of one node -----------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=12))
def test_dedicated_places_each_group_on_a_free_aligned_block_of_one_node_and_never_overlaps(sizes: list[int]) -> None:
    s = _cluster("dedicated", 16)
    taken: set[str] = set()
    for n, k in enumerate(sizes):
        (action,) = s.handle(JobOpened(f"j{n}", devices=k), 0.0)
        if isinstance(action, Fail):  # only when no aligned block of k is free
            free = {f"w{i}" for i in range(16)} - taken
            assert not any({f"w{i}" for i in range(b, b + k)} <= free for b in range(0, 16, k))
            continue
        assert isinstance(action, Place)
        members = action.members or (action.worker_id,)
        first = _index(members[0])
        assert [_index(m) for m in members] == list(range(first, first + k))  # contiguous
        assert first % k == 0 and first // 8 == (first + k - 1) // 8  # aligned, on one node
        assert not taken & set(members)  # a device of its own
        taken |= set(members)


def test_sharing_policies_put_a_group_on_the_least_loaded_aligned_block_next_to_single_jobs() -> None:
    s = _cluster("fifo", 8)
    assert s.handle(JobOpened("a"), 0.0) == [Place("a", "w0")]
    assert s.handle(JobOpened("b"), 0.0) == [Place("b", "w1")]
    assert s.handle(JobOpened("g", devices=4), 0.0) == [Place("g", "w4", members=("w4", "w5", "w6", "w7"))]
    assert s.handle(JobOpened("h", devices=2), 0.0) == [Place("h", "w2", members=("w2", "w3"))]
    assert s.handle(JobOpened("c"), 0.0) == [Place("c", "w0")]  # every device holds one job now: shared


def test_a_group_job_is_refused_when_it_cannot_be_placed_as_asked() -> None:
    s = _cluster("fifo", 4)
    for opened in (JobOpened("g", devices=8), JobOpened("h", devices=3), JobOpened("p", devices=2, pooled=True)):
        (fail,) = s.handle(opened, 0.0)
        assert isinstance(fail, Fail) and isinstance(fail.error, NoWorkersError)
    lone = Scheduler("fifo")
    lone.handle(WorkerJoined("x"), 0.0)  # no node: single-device jobs only
    (fail,) = lone.handle(JobOpened("g", devices=2), 0.0)
    assert isinstance(fail, Fail) and "aligned block of 2" in fail.error.message


# -- gang dispatch -----------------------------------------------------------------------------


def test_a_group_call_starts_only_once_every_member_drained_and_nothing_else_starts_there_meanwhile() -> None:
    s = _cluster("fifo", 2)
    s.handle(JobOpened("a"), 0.0)  # w0
    s.handle(JobOpened("b"), 0.0)  # w1
    s.handle(JobOpened("g", devices=2), 0.0)  # w0, w1
    assert s.handle(CallSubmitted(1, "a", "forward_backward"), 1.0) == [Dispatch(1, "w0")]
    assert s.handle(CallSubmitted(2, "g", "forward_backward"), 2.0) == []  # w0 is busy: not on w1 alone
    assert s.handle(CallSubmitted(3, "b", "forward_backward"), 3.0) == []  # w1 is claimed by the group
    assert s.handle(CallFinished(1), 4.0) == [Dispatch(2, "w0")]  # the leader: it runs on both
    assert s.running_on("w0") == s.running_on("w1") == {"forward_backward"}
    assert s.handle(CallSubmitted(4, "a", "optim_step"), 5.0) == []
    assert s.handle(CallFinished(2), 6.0) == [Dispatch(4, "w0"), Dispatch(3, "w1")]
    # Accelerator-seconds: the group's call held two devices for 2 s.
    assert s.ledger.accelerator_s("g", 6.0) == pytest.approx(4.0)


def test_in_the_simulator_a_group_call_runs_on_all_its_members_at_once_and_alone() -> None:
    result = _mixed(seed=0, record_timeline=True)
    group_jobs = {f"{j.name}-{i}": j.members for i, j in enumerate(result.jobs) if j.members}
    assert group_jobs and all(len(m) in (2, 4) for m in group_jobs.values())
    spans = result.timeline
    for job_id, members in group_jobs.items():
        calls: dict[tuple[float, float, str], set[str]] = {}
        for span in spans:
            if span.job == job_id:
                calls.setdefault((span.start_s, span.end_s, span.kind), set()).add(span.device)
        assert calls and all(devices == set(members) for devices in calls.values())  # never a subset
        for (start, end, _), devices in calls.items():  # and nothing else runs there meanwhile
            assert not any(
                o.device in devices and o.job != job_id and o.start_s < end - 1e-9 and o.end_s > start + 1e-9
                for o in spans
            )


# -- residency per member ----------------------------------------------------------------------


def test_a_group_state_moves_on_every_member_together_and_is_in_only_when_all_have_moved() -> None:
    s = _cluster("fifo", 2, memory_bytes=100)
    s.handle(JobOpened("a", state_bytes=60), 0.0)  # on w0's device
    s.handle(JobOpened("b"), 0.0)  # w1
    assert s.handle(JobOpened("g", state_bytes=50, devices=2), 0.0) == [Place("g", "w0", members=("w0", "w1"))]
    assert s.residency("g").tier == "host"  # no room for its shard on w0
    assert s.handle(CallSubmitted(1, "g", "forward_backward"), 1.0) == [Swap("a", "w0", "host", 60)]
    assert s.handle(SwapDone("a", 1.0, worker_id="w0"), 2.0) == [
        Swap("g", "w0", "device", 50),
        Swap("g", "w1", "device", 50),
    ]
    assert [s.used_bytes(w) for w in ("w0", "w1")] == [50, 50]  # each member's shard, reserved
    assert s.handle(SwapDone("g", 1.0, worker_id="w1"), 3.0) == []  # w0's shard is still moving
    assert s.residency("g").tier == "to_device"
    assert s.handle(SwapDone("g", 1.0, worker_id="w0"), 4.0) == [Dispatch(1, "w0")]
    assert s.residency("g").tier == "device"


def _used_bytes_spy(sim: Simulation, memory_bytes: float) -> dict[str, float]:
    """Check after every event that no worker holds more state than its budget; return the peaks."""
    scheduler = sim.scheduler
    handle = scheduler.handle
    peaks: dict[str, float] = {}

    def spy(event: Any, now: float) -> list:
        actions = handle(event, now)
        for w in scheduler.workers():
            assert w.used_bytes <= memory_bytes, (event, w.worker_id, w.used_bytes)
            peaks[w.worker_id] = max(peaks.get(w.worker_id, 0), w.used_bytes)
        return actions

    scheduler.handle = spy  # type: ignore[method-assign]
    return peaks


def test_under_a_memory_budget_every_member_stays_within_it_and_every_job_finishes() -> None:
    group = JobModel("g", steps=4, turns=2, tool_latency_s=Lognormal(20.0, 0.5), state_bytes=50 * 10**9, devices=2)
    single = JobModel("s", steps=4, turns=2, tool_latency_s=Lognormal(20.0, 0.5), state_bytes=40 * 10**9)
    sim = Simulation("plex", 2, [group, single, single, single], seed=0, memory_bytes=80e9, swap_bytes_per_s=5e9)
    peaks = _used_bytes_spy(sim, 80e9)
    result = sim.run()
    assert all(j.finished_s is not None and not j.error for j in result.jobs)
    assert result.swaps > 0 and max(peaks.values()) > 0  # state did move; the budget held throughout


# -- sharing a node, determinism ---------------------------------------------------------------


def _mixed(seed: int, policy: str = "fifo", record_timeline: bool = False) -> SimResult:
    """One 8-device node: a 4-device job, a 2-device job and five single-device jobs."""
    agent = JobModel("one", steps=3, turns=2, tool_latency_s=Lognormal(3.0, 1.0))
    four = group_job("four", QWEN3["8B"], 4, steps=3, turns=2, rollouts=16, tool_latency_s=Lognormal(3.0, 1.0))
    two = group_job("two", QWEN3["4B"], 2, steps=3, turns=2, rollouts=16, tool_latency_s=Lognormal(3.0, 1.0))
    jobs = [agent, four, agent, two, agent, agent, agent]
    return Simulation(policy, 8, jobs, seed=seed, record_timeline=record_timeline).run()


@pytest.mark.parametrize("policy", ["fifo", "plex"])
def test_a_group_job_and_single_device_jobs_share_a_node_and_all_finish(policy: str) -> None:
    result = _mixed(seed=1, policy=policy)
    assert all(j.finished_s is not None and not j.error for j in result.jobs)
    members = {m for j in result.jobs for m in j.members}
    singles = {j.worker for j in result.jobs if not j.members}
    assert members & singles  # a device serving a group and a single-device job by turns
    assert sum(j.accelerator_s for j in result.jobs) == pytest.approx(sum(result.busy_s.values()))
    for w, busy in result.busy_s.items():
        assert busy <= result.held_s.get(w, 0.0) + 1e-9


def test_a_run_with_groups_replays_exactly_for_a_seed_and_differs_for_another() -> None:
    def run(seed: int) -> list[tuple[str, str, str, float, float]]:
        return [(s.device, s.job, s.kind, s.start_s, s.end_s) for s in _mixed(seed, record_timeline=True).timeline]

    assert run(4) == run(4)
    assert run(4) != run(5)


# -- a member lost -----------------------------------------------------------------------------


def _running_group(recoverable: bool) -> Scheduler:
    s = _cluster("fifo", 4, memory_bytes=100)
    s.handle(JobOpened("g", state_bytes=30, devices=2), 0.0)  # w0, w1
    s.handle(JobSized("g", 30, snapshots=recoverable), 0.0)
    assert s.handle(CallSubmitted(1, "g", "forward_backward"), 1.0) == [Dispatch(1, "w0")]
    return s


def test_a_recoverable_group_that_loses_a_member_moves_as_a_unit_to_a_new_block_and_redoes_its_call() -> None:
    s = _running_group(recoverable=True)
    actions = s.handle(WorkerLost("w1", "test"), 2.0)
    # Its restore (of the scheduler's own) first, on the new block.
    assert actions == [Recover("g", "w2", members=("w2", "w3")), Dispatch(-1, "w2", own=OwnCall("g", "restore"))]
    assert s.used_bytes("w0") == 0 and not s.running_on("w0")  # its surviving shard is dropped
    assert s.handle(CallFinished(-1), 3.0) == [Dispatch(1, "w2")]  # the call it was running, again
    assert [s.used_bytes(w) for w in ("w2", "w3")] == [30, 30]


def test_a_group_without_a_saved_state_that_loses_a_member_fails_as_a_unit() -> None:
    s = _running_group(recoverable=False)
    actions = s.handle(WorkerLost("w1", "test"), 2.0)
    assert [(type(a), getattr(a, "call_id", None)) for a in actions] == [(Fail, 1), (JobLost, None)]
    assert isinstance(actions[0], Fail) and isinstance(actions[0].error, WorkerLostError)
    assert s.used_bytes("w0") == 0 and not s.running_on("w0")
    assert s.handle(JobOpened("a"), 3.0) == [Place("a", "w0")]  # w0 is free for others


def test_a_recoverable_group_whose_gang_broke_is_rebuilt_from_its_snapshot_and_redoes_its_call() -> None:
    s = _running_group(recoverable=True)
    actions = s.handle(GangBroken("g", "a collective timed out"), 2.0)
    # Its members may differ: its state is made again from the snapshot, on the least loaded block
    # (its own, now free), before the call runs again.
    assert actions == [Recover("g", "w0", members=("w0", "w1")), Dispatch(-1, "w0", own=OwnCall("g", "restore"))]
    assert s.handle(CallFinished(-1), 3.0) == [Dispatch(1, "w0")]
    assert [s.used_bytes(w) for w in ("w0", "w1", "w2", "w3")] == [30, 30, 0, 0]


def test_a_group_without_a_saved_state_whose_gang_broke_is_lost() -> None:
    s = _running_group(recoverable=False)
    actions = s.handle(GangBroken("g", "a collective timed out"), 2.0)
    assert [(type(a), getattr(a, "call_id", None)) for a in actions] == [(Fail, 1), (JobLost, None)]
    assert isinstance(actions[0], Fail) and isinstance(actions[0].error, GangBrokenError)
    assert not s.running_on("w0") and not s.running_on("w1")


# -- costs -------------------------------------------------------------------------------------


def test_a_group_costs_less_per_call_as_it_grows_and_pays_its_communication_on_top() -> None:
    llm = QWEN3["8B"]
    costs = {k: group_costs(llm, k) for k in (1, 2, 4, 8)}
    for small, big in ((1, 2), (2, 4), (4, 8)):  # compute- and bandwidth-bound calls get faster
        for name in ("decode_step_s", "train_s_per_token", "optim_step_s", "state_bytes"):
            assert costs[big][name] < costs[small][name], (name, big)
    flops = 6 * llm.params / (H200.bf16_flops * H200.train_mfu)
    assert costs[1]["train_s_per_token"] == pytest.approx(flops)  # one device: no communication
    for k in (2, 4, 8):
        gathers = ring_s(3 * llm.weight_bytes, k) / MICROBATCH_TOKENS
        assert gathers > 0
        assert costs[k]["train_s_per_token"] == pytest.approx(flops / k + gathers)
        assert costs[k]["sync_s"] > costs[1]["sync_s"]  # weight sync gathers over the links
    assert ring_s(1e9, 1) == 0.0
    assert ring_s(1e9, 8) == pytest.approx(1e9 * 7 / 8 / (H200.link_bytes_per_s * H200.link_efficiency))
