"""The simulator drives the real scheduler on virtual time: determinism, accounting, policies."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from plexrl.coordinator.buckets import Mlfq
from plexrl.coordinator.events import CallSubmitted
from plexrl.coordinator.rebalance import Rebalancer
from plexrl.coordinator.scheduler import Scheduler
from plexrl.sim import JobModel, Lognormal, SimResult, Simulation
from plexrl.sim.driver import WorkerSpec, _Device, _Runner, _Running
from plexrl.sim.workload import Fork, Step, Wait, Work, critical_path_s, hardness_sigma, job_rngs, program

AGENTIC = JobModel("agent", steps=5, turns=3, tool_latency_s=Lognormal(4.0, 1.0))


def test_a_run_replays_exactly_for_a_seed_and_differs_for_another() -> None:
    def run(seed: int) -> list[float]:
        result = Simulation("fifo", 2, [AGENTIC] * 4, seed=seed).run()
        return [j.wall_s for j in result.jobs]

    assert run(1) == run(1)
    assert run(1) != run(2)


@pytest.mark.parametrize(("policy", "workers"), [("dedicated", 4), ("fifo", 1), ("fifo", 2)])
def test_every_job_finishes_and_accelerator_seconds_add_up(policy: str, workers: int) -> None:
    result = Simulation(policy, workers, [AGENTIC] * 4, seed=0).run()
    assert all(j.finished_s is not None and not j.error for j in result.jobs)
    assert all(j.calls == AGENTIC.steps * (AGENTIC.turns + 3) for j in result.jobs)
    assert sum(j.accelerator_s for j in result.jobs) == pytest.approx(sum(result.busy_s.values()))
    for w, busy in result.busy_s.items():  # one call at a time per device
        assert busy <= result.held_s[w] + 1e-9


def test_dedicated_gives_each_job_its_own_worker_and_refuses_a_job_too_many() -> None:
    result = Simulation("dedicated", 3, [AGENTIC] * 4, seed=0).run()
    placed = [j for j in result.jobs if not j.error]
    assert sorted(j.worker for j in placed) == ["w0", "w1", "w2"]
    (refused,) = [j for j in result.jobs if j.error]
    assert "one job per worker" in refused.error and refused.finished_s is None
    # A dedicated device is held exactly while its job runs.
    for j in placed:
        assert result.held_s[j.worker] <= j.wall_s + 1e-9


def test_sharing_a_device_between_jobs_that_mostly_wait_on_tools_saves_device_hours() -> None:
    jobs = [AGENTIC] * 4
    dedicated = Simulation("dedicated", 4, jobs, seed=0).run()
    shared = Simulation("fifo", 1, jobs, seed=0).run()
    assert shared.device_hours < dedicated.device_hours
    assert shared.busy_fraction > dedicated.busy_fraction


def test_under_memory_pressure_plex_moves_state_less_than_fifo_and_every_job_finishes() -> None:
    """Four 30 GB jobs on one 80 GB device (two fit): fifo moves the least recently used job out
    whenever another needs in; plex only when the idle gap it expects pays for the move."""
    jobs = [JobModel("agent", steps=6, turns=3, tool_latency_s=Lognormal(20.0, 0.5), state_bytes=30 * 10**9)] * 4
    runs = {
        policy: Simulation(policy, 1, jobs, seed=0, memory_bytes=80e9, swap_bytes_per_s=2e9).run()
        for policy in ("fifo", "plex")
    }
    for result in runs.values():
        assert all(j.finished_s is not None for j in result.jobs)
    assert 0 < runs["plex"].swaps < runs["fifo"].swaps


def _one_generate(base: str) -> JobModel:
    """One generate call of exactly 100 decode steps of 10 ms (8 ms of it reading shared weights)."""
    return JobModel(
        "g",
        steps=1,
        turns=1,
        rollouts=1,
        output_tokens=Lognormal(99.5, 0.0),  # 100 after rounding up
        decode_step_s=0.01,
        shared_step_fraction=0.8,
        tool_latency_s=Lognormal(1e-6, 0.0),
        train_s_per_token=0.0,
        optim_step_s=0.0,
        sync_s=0.0,
        base=base,
    )


@pytest.mark.parametrize(
    ("bases", "seconds"),
    [
        (["x"], 1.0),  # alone: 100 steps x 10 ms
        (["x", "x"], 1.2),  # batched on one base: a round reads the weights once (8 ms) + 2 x 2 ms
        (["x", "y"], 2.0),  # two bases: a round reads both models' weights, 2 x 10 ms
    ],
)
def test_generates_batched_on_a_device_share_the_weight_reads_of_their_base(bases: list[str], seconds: float) -> None:
    result = Simulation("plex", 1, [_one_generate(b) for b in bases], slots=4, record_timeline=True).run()
    generates = [(s.end_s - s.start_s) for s in result.timeline][: len(bases)]
    assert generates == pytest.approx([seconds] * len(bases))
    assert sum(j.accelerator_s for j in result.jobs) == pytest.approx(sum(result.busy_s.values()))


def test_jobs_open_when_they_arrive() -> None:
    late = JobModel("late", steps=1, arrival_s=500.0)
    result = Simulation("fifo", 1, [AGENTIC, late], seed=0).run()
    assert result.jobs[1].started_s == 500.0 and result.jobs[1].finished_s is not None


# -- pooled agents (Libra): trajectories turn by turn, buckets, roles ---------------------------

POOLED = JobModel(
    "pooled", steps=2, rollouts=6, turns=2, output_tokens=Lognormal(40.0, 0.8), tool_latency_s=Lognormal(1.0, 0.5),
    decode_step_s=0.01, shared_step_fraction=0.5, kv_step_s_per_token=1e-5, tool_error_p=0.3, difficulty_sigma=0.8,
    train_s_per_token=1e-4, pooled=True,
)  # fmt: skip


def _turns(scheduler: Scheduler, workers: list[WorkerSpec], move_s: float = 0.0) -> tuple[SimResult, list[tuple]]:
    """Run two pooled jobs; return the result and every turn submitted (job, trajectory, steps)."""
    submitted: list[tuple] = []
    handle = scheduler.handle

    def spy(event: Any, now: float) -> list:
        if isinstance(event, CallSubmitted) and event.trajectory:
            submitted.append((event.job_id, event.trajectory, event.signals))
        return handle(event, now)

    scheduler.handle = spy  # type: ignore[method-assign]
    sim = Simulation("fifo", len(workers), [POOLED, POOLED], seed=3, worker_specs=workers, scheduler=scheduler,
                     move_s=move_s)  # fmt: skip
    return sim.run(), submitted


def test_pooled_jobs_run_every_trajectory_and_train_on_all_of_them_in_both_routings() -> None:
    static, static_turns = _turns(
        Scheduler("fifo", mlfq=Mlfq(levels=1)), [WorkerSpec("rollout", 0, 4)] * 2 + [WorkerSpec("train")]
    )
    libra, libra_turns = _turns(
        Scheduler("fifo", rebalancer=Rebalancer(prior_move_s=0.1)),
        [WorkerSpec("rollout", 0, 4), WorkerSpec("rollout", 2, 2, tp=2, comm_s=1e-4), WorkerSpec("train")],
        move_s=0.1,
    )
    for result in (static, libra):
        assert all(j.finished_s is not None and not j.error for j in result.jobs)
        assert [j.trained_samples for j in result.jobs] == [POOLED.steps * POOLED.rollouts] * 2
        assert [len(j.steps_done_s) for j in result.jobs] == [POOLED.steps] * 2
    # The same work whatever the routing: the same turns, drawn before any of them ran.
    assert sorted(static_turns, key=repr) == sorted(libra_turns, key=repr)
    assert len(static_turns) >= 2 * POOLED.steps * POOLED.rollouts * POOLED.turns
    assert any(s.tool_errors for _, _, s in static_turns)  # some tools failed: retried turns


def test_a_tensor_parallel_worker_runs_a_decode_round_in_a_share_of_the_time_plus_its_all_reduces() -> None:
    one = JobModel("one", steps=1, rollouts=1, turns=1, output_tokens=Lognormal(99.5, 0.0), decode_step_s=0.01,
                   tool_latency_s=Lognormal(1e-3, 0.0), train_s_per_token=0.0, optim_step_s=0.0, sync_s=0.0,
                   pooled=True, prompt_tokens=0, observation_tokens=0)  # fmt: skip
    specs = [WorkerSpec("rollout", 0, 1, tp=4, comm_s=0.001), WorkerSpec("train")]
    result = Simulation("fifo", 2, [one], seed=0, worker_specs=specs, record_timeline=True).run()
    (turn,) = [(s.start_s, s.end_s) for s in result.timeline if s.device == "w0"]
    assert turn[1] - turn[0] == pytest.approx(100 * (0.01 / 4 + 0.001))
    assert result.held_s["w0"] == pytest.approx(4 * (turn[1] - turn[0]))  # four devices held


def test_a_jobs_dependency_chain_bounds_its_time_and_is_what_it_takes_alone() -> None:
    """``critical_path_s``: the forked trajectories side by side (the slowest counts), then the
    calls after them; a lone job on a worker of its own takes exactly its chain."""

    def steps() -> Iterator[Step]:
        yield Fork([iter([Work("generate", steps=10, own_step_s=0.02, shared_step_s=0.06), Wait(1.0)]),
                    iter([Work("generate", steps=20, own_step_s=0.02, shared_step_s=0.06)])])  # fmt: skip
        yield Work("forward_backward", seconds=3.0)

    assert critical_path_s(steps()) == pytest.approx(max(10 * 0.08 + 1.0, 20 * 0.08) + 3.0)
    assert critical_path_s(steps(), tp=4, comm_s=0.01) == pytest.approx(max(10 * 0.03 + 1.0, 20 * 0.03) + 3.0)
    one = JobModel("one", steps=2, rollouts=3, turns=2, output_tokens=Lognormal(20.0, 0.5), decode_step_s=0.01,
                   tool_latency_s=Lognormal(0.5, 0.5), pooled=True, tool_error_p=0.3)  # fmt: skip
    (rng,) = job_rngs(7, 1)
    chain = critical_path_s(program(one, rng))
    result = Simulation("fifo", 2, [one], seed=7, worker_specs=[WorkerSpec("rollout", 0, 8), WorkerSpec("train")]).run()
    assert result.end_s >= chain > 0
    # Batched turns share a decode round, so alone on a wide worker the job may take longer, never shorter.
    assert result.end_s == pytest.approx(chain, rel=0.5)


def test_an_exclusive_call_pauses_the_generates_on_its_device_and_they_go_on_after() -> None:
    def running(call_id: int, work: Work, exclusive: bool = False) -> _Running:
        left = float(work.steps) if work.kind == "generate" else work.seconds
        return _Running(call_id, "j", work, left, 0.0, _Runner(iter([])), exclusive=exclusive)

    turn = Work("generate", steps=100, own_step_s=0.01)
    train = Work("forward_backward", seconds=2.0)
    shared, alone = _Device(), _Device()
    shared.running = {1: running(1, turn), 2: running(2, train)}
    alone.running = {1: running(1, turn), 2: running(2, train, exclusive=True)}
    assert shared.rates() == {1: pytest.approx(50.0), 2: 0.5}  # half the device each
    assert alone.rates() == {1: 0.0, 2: 1.0}  # the training has it to itself; the turn waits
    alone.running.pop(2)
    assert alone.rates() == {1: pytest.approx(100.0)}


def test_a_workloads_turn_lengths_and_hardness_are_recovered_from_its_trajectories() -> None:
    """What calibrates the simulated workload from a real run, checked on the simulator's own draws."""
    model = JobModel("agent", steps=1, rollouts=2000, turns=4, output_tokens=Lognormal(300.0, 0.6),
                     difficulty_sigma=0.8, pooled=True)  # fmt: skip
    rng = np.random.default_rng(0)
    (fork, *_) = program(model, rng)
    assert isinstance(fork, Fork)
    lengths = [[w.steps for w in p if isinstance(w, Work)] for p in fork.programs]
    # A turn's length is its hardness times its own draw: spreads add in log space (rounding aside).
    fitted = Lognormal.fit([n for t in lengths for n in t])
    assert fitted.sigma == pytest.approx(float(np.hypot(0.6, 0.8)), rel=0.05)
    assert fitted.median == pytest.approx(300.0, rel=0.1)
    assert hardness_sigma(lengths) == pytest.approx(0.8, rel=0.03)  # uncorrected for the turns: 0.85
    assert hardness_sigma([[n] for t in lengths for n in t]) == 0.0  # single turns say nothing of it
    # A turn that sampled nothing has no log length: it is left out of both, not taken as -inf.
    empty = [[*t, 0] for t in lengths]
    assert Lognormal.fit(n for t in empty for n in t) == fitted
    assert hardness_sigma(empty) == hardness_sigma(lengths)
