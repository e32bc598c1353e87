"""A worker's vLLM engines sleep while its training needs their memory and wake before the next
call that samples: the scheduler's ordering of sleeps, wakes and calls, and what it charges."""

from __future__ import annotations

import msgspec
import pytest

from plexrl.coordinator.events import (
    CallFinished,
    CallSubmitted,
    Dispatch,
    EnginesMoved,
    JobOpened,
    MoveEngines,
    Place,
    Tick,
    WorkerJoined,
)
from plexrl.coordinator.scheduler import Scheduler
from plexrl.models import QWEN3_CONFIGS
from plexrl.plan import GiB, JobShape, ModelShape, WorkerPlan, engine_bytes, footprint, must_sleep, sleep_level

QWEN3_8B = ModelShape.of(QWEN3_CONFIGS["8B"])
LORA_8B = JobShape(QWEN3_8B, lora_rank=8)
# An 80 GB card whose engine reserves 75% of it: Qwen3-8B's training does not fit beside the engine.
BIG_KV = WorkerPlan(
    capacity_bytes=80 * GiB,
    device_type="cuda",
    dtype="bfloat16",
    sampler="vllm",
    gpu_memory_utilization=0.75,
    host_bytes=512 * GiB,
)
ENGINE = engine_bytes(BIG_KV, QWEN3_8B, lora=True)


def _cluster(plan: WorkerPlan, jobs: tuple[str, ...] = ("a", "b")) -> Scheduler:
    """One vLLM worker, ``jobs`` LoRA jobs of Qwen3-8B open on it."""
    s = Scheduler("fifo")
    s.handle(WorkerJoined("w0", slots=8, plan=plan, stateless_generates=True, background_calls=("open", "save")), 0.0)
    for i, job in enumerate(jobs):
        assert s.handle(JobOpened(job, base="qwen3-8b", shape=LORA_8B), 0.0) == [Place(job, "w0")]
        assert s.handle(CallSubmitted(100 + i, job, "open"), 0.0) == [Dispatch(100 + i, "w0")]
        s.handle(CallFinished(100 + i), 0.0)
    return s


def test_the_plan_asks_for_a_sleep_only_when_training_does_not_fit_beside_the_engines() -> None:
    fp = footprint(BIG_KV, LORA_8B)
    weights, activations = fp.parts["base weights"], fp.parts["activations"]
    assert must_sleep(BIG_KV, fp.state, weights, activations, ENGINE)
    small_kv = msgspec.structs.replace(BIG_KV, gpu_memory_utilization=0.3)
    small = engine_bytes(small_kv, QWEN3_8B, lora=True)
    assert not must_sleep(small_kv, fp.state, weights, activations, small)
    assert must_sleep(msgspec.structs.replace(small_kv, engine_sleep="always"), fp.state, weights, activations, small)
    assert not must_sleep(msgspec.structs.replace(BIG_KV, engine_sleep="never"), fp.state, weights, activations, ENGINE)
    # Level 1 (weights offloaded to the host) when the host holds them; else 2 (dropped, refit on wake).
    assert sleep_level(BIG_KV, ENGINE) == 1
    assert sleep_level(msgspec.structs.replace(BIG_KV, host_bytes=64 * GiB), ENGINE) == 2


def test_training_waits_for_the_engines_to_sleep_after_the_generates_drain_and_a_wake_precedes_the_next_generate() -> (
    None
):
    s = _cluster(BIG_KV)
    assert s.handle(CallSubmitted(1, "a", "generate"), 1.0) == [Dispatch(1, "w0")]
    # a's training needs the engine's memory: nothing is sent while a generate runs on it, and
    # b's generate, submitted after, waits behind the sleep the training asked for.
    assert s.handle(CallSubmitted(2, "a", "forward_backward"), 2.0) == []
    assert s.handle(CallSubmitted(3, "b", "generate"), 3.0) == []
    assert s.handle(CallFinished(1), 4.0) == [MoveEngines("w0", "asleep", 1, ENGINE, "a")]
    assert s.handle(EnginesMoved("w0", 1.5), 5.5) == [Dispatch(2, "w0")]
    assert s.ledger.jobs["a"].swap_s == 1.5 and s.ledger.jobs["a"].swaps == 1
    # The engines stay asleep as long as a round of sleep and wake costs (1.5 s measured so far):
    # a's optimizer step, submitted right after its forward-backward, runs without a wake between.
    assert s.handle(CallFinished(2), 6.0) == []
    assert s.handle(CallSubmitted(4, "a", "optim_step"), 6.1) == [Dispatch(4, "w0")]
    assert s.handle(CallFinished(4), 6.5) == []
    assert s.handle(Tick(), 6.9) == []  # 1.4 s asleep: not yet
    assert s.handle(Tick(), 7.0) == [MoveEngines("w0", "awake", 1, ENGINE, "b")]
    assert s.handle(CallSubmitted(5, "a", "forward_backward"), 7.1) == []  # the wake is under way
    assert s.handle(EnginesMoved("w0", 0.5), 7.5) == [Dispatch(3, "w0")]
    assert s.ledger.jobs["b"].swap_s == 0.5  # the wake was for b's generate
    assert s.ledger.jobs["b"].swap_bytes == ENGINE


def test_a_training_call_that_fits_beside_the_engines_runs_beside_the_generates() -> None:
    s = _cluster(msgspec.structs.replace(BIG_KV, gpu_memory_utilization=0.3))
    assert s.handle(CallSubmitted(1, "a", "generate"), 1.0) == [Dispatch(1, "w0")]
    assert s.handle(CallSubmitted(2, "b", "forward_backward"), 2.0) == [Dispatch(2, "w0")]
    assert s.handle(CallSubmitted(3, "b", "sync_weights"), 2.0) == []  # a barrier: after b's training
    assert s.handle(CallFinished(2), 3.0) == [Dispatch(3, "w0")]


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_always_sleeps_around_every_training_phase_and_counts_the_memory_only_where_a_sleep_frees_it(
    device_type: str,
) -> None:
    """On CPU a sleep pauses the engine and frees nothing: the plan counts both there."""
    plan = msgspec.structs.replace(BIG_KV, gpu_memory_utilization=0.3, engine_sleep="always", device_type=device_type)
    s = _cluster(plan, ("a",))
    (move,) = s.handle(CallSubmitted(1, "a", "forward_backward"), 1.0)
    assert isinstance(move, MoveEngines) and move.to == "asleep"
    assert s.handle(EnginesMoved("w0", 0.01), 1.01) == [Dispatch(1, "w0")]
    fp = footprint(plan, LORA_8B)
    both = fp.parts["activations"] + fp.parts["shared engine"]
    larger = max(fp.parts["activations"], fp.parts["shared engine"])
    held = fp.parts["base weights"] + (both if device_type == "cpu" else larger)
    assert fp.base == held


def test_a_failed_sleep_leaves_the_engines_awake_and_they_are_not_put_to_sleep_again() -> None:
    s = _cluster(BIG_KV, ("a",))
    assert s.handle(CallSubmitted(1, "a", "forward_backward"), 1.0) == [MoveEngines("w0", "asleep", 1, ENGINE, "a")]
    assert s.handle(EnginesMoved("w0", 0.2, ok=False), 1.2) == [Dispatch(1, "w0")]
    s.handle(CallFinished(1), 2.0)
    assert s.handle(CallSubmitted(2, "a", "generate"), 3.0) == [Dispatch(2, "w0")]  # no wake: they are awake
    assert s.handle(CallSubmitted(3, "a", "forward_backward"), 3.0) == [Dispatch(3, "w0")]
