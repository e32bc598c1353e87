"""The simulator drives the real scheduler on virtual time: determinism, accounting, policies."""

from __future__ import annotations

import pytest

from plexrl.sim import JobModel, Lognormal, Simulation

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
    generates = [(end - start) for _, _, start, end in result.timeline][: len(bases)]
    assert generates == pytest.approx([seconds] * len(bases))
    assert sum(j.accelerator_s for j in result.jobs) == pytest.approx(sum(result.busy_s.values()))


def test_jobs_open_when_they_arrive() -> None:
    late = JobModel("late", steps=1, arrival_s=500.0)
    result = Simulation("fifo", 1, [AGENTIC, late], seed=0).run()
    assert result.jobs[1].started_s == 500.0 and result.jobs[1].finished_s is not None
