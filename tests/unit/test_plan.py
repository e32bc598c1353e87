"""The device memory plan: what it counts, and how the scheduler places and refuses jobs by it."""

from __future__ import annotations

import math

import msgspec
import pytest

from plexrl.coordinator.events import (
    CallFinished,
    CallSubmitted,
    Dispatch,
    Fail,
    JobClosed,
    JobOpened,
    Place,
    Swap,
    WorkerJoined,
)
from plexrl.coordinator.scheduler import Scheduler
from plexrl.errors import JobTooLargeError
from plexrl.models import QWEN3_CONFIGS
from plexrl.plan import (
    GiB,
    JobShape,
    ModelShape,
    WorkerPlan,
    activation_bytes,
    engine_bytes,
    footprint,
    free_bytes,
    lora_jobs_per_device,
    refusal,
)

QWEN3_1_7B = ModelShape.of(QWEN3_CONFIGS["1.7B"])
QWEN3_8B = ModelShape.of(QWEN3_CONFIGS["8B"])
H100 = WorkerPlan(capacity_bytes=80 * GiB, device_type="cuda", dtype="bfloat16", sampler="vllm")
AWAKE_H100 = msgspec.structs.replace(H100, engine_sleep="never")  # its engines hold their memory throughout


def test_the_shapes_give_the_published_parameter_counts() -> None:
    assert QWEN3_1_7B.params == 1_720_574_976  # "1.7B"; 1.4B without the (tied) embedding
    assert QWEN3_8B.params == 8_190_735_360  # "8.2B"
    assert QWEN3_8B.kv_bytes_per_token(2) == 144 * 1024


def test_a_lora_job_holds_16_bytes_per_trained_parameter_and_its_base_is_counted_apart() -> None:
    job = JobShape(QWEN3_8B, lora_rank=8)
    fp = footprint(H100, job)
    assert fp.state == 16 * QWEN3_8B.lora_params(8)
    assert fp.pinned == 0
    weights, engine = QWEN3_8B.params * 2, engine_bytes(H100, QWEN3_8B, lora=True)
    activations = activation_bytes(H100, QWEN3_8B, True)
    assert engine == int(0.3 * 80 * GiB) and 0 < activations < engine
    # Its engine sleeps while it trains, so the device holds the engine or the activations, not both.
    assert fp.base == weights + engine
    assert footprint(AWAKE_H100, job).base == weights + engine + activations
    assert refusal(H100, job, fp) is None


def test_a_full_fine_tune_pins_an_engine_of_its_own() -> None:
    fp = footprint(H100, JobShape(QWEN3_1_7B))
    assert fp.state == 16 * QWEN3_1_7B.params
    assert fp.pinned == engine_bytes(H100, QWEN3_1_7B, lora=False) and fp.parts["shared engine"] == 0


def test_qwen3_8b_full_fine_tune_is_refused_on_an_80_gb_card_naming_every_part() -> None:
    job = JobShape(QWEN3_8B)
    why = refusal(H100, job, footprint(H100, job))
    assert why is not None
    for part in ("trained state 122 GiB", "base weights 15.3 GiB", "own engine 24 GiB", "for jobs"):
        assert part in why


def test_an_engine_too_small_for_its_weights_is_refused_with_the_setting_to_change() -> None:
    small = WorkerPlan(capacity_bytes=24 * GiB, device_type="cuda", dtype="bfloat16", sampler="vllm")
    job = JobShape(QWEN3_8B, lora_rank=8)
    why = refusal(small, job, footprint(small, job))
    assert why is not None and "--gpu-memory-utilization 0.3" in why


def test_lora_jobs_per_device_divide_the_room_the_base_leaves() -> None:
    job = JobShape(QWEN3_8B, lora_rank=8)
    n = lora_jobs_per_device(H100, job)
    fp = footprint(H100, job)
    assert n == math.floor((free_bytes(H100) - fp.base) / fp.state) and n > 20


def test_checkpointing_bounds_activations_to_a_fraction() -> None:
    assert activation_bytes(H100, QWEN3_8B, True) < activation_bytes(H100, QWEN3_8B, False) / 4


# -- the scheduler places by the plan ------------------------------------------------------------


def _worker(s: Scheduler, worker_id: str, plan: WorkerPlan, memory_bytes: float = math.inf) -> None:
    s.handle(WorkerJoined(worker_id, slots=4, memory_bytes=memory_bytes, plan=plan), 0.0)


def test_a_job_that_fits_no_worker_is_refused_at_open_with_the_plans_numbers() -> None:
    s = Scheduler("plex")
    _worker(s, "w0", H100)
    (fail,) = s.handle(JobOpened("big", base="qwen3-8b", shape=JobShape(QWEN3_8B)), 0.0)
    assert isinstance(fail, Fail) and fail.call_id is None
    assert isinstance(fail.error, JobTooLargeError)
    message = str(fail.error)
    assert "job big fits no worker: on w0 (cuda, 80 GiB, bfloat16)" in message
    assert "trained state 122 GiB" in message
    # The same model as a LoRA job fits, and is sized by the plan before it opens.
    assert s.handle(JobOpened("small", base="qwen3-8b", shape=JobShape(QWEN3_8B, lora_rank=8)), 0.0) == [
        Place("small", "w0")
    ]


def test_a_base_model_is_counted_once_per_worker_and_released_with_its_last_job() -> None:
    s = Scheduler("plex")
    _worker(s, "w0", H100)
    lora = JobShape(QWEN3_1_7B, lora_rank=8)
    fp = footprint(H100, lora)
    for job in ("a", "b"):
        s.handle(JobOpened(job, base="qwen3-1.7b", shape=lora), 0.0)
    assert s.budget("w0") == free_bytes(H100) - fp.base
    assert s.used_bytes("w0") == 2 * fp.state  # both resident
    s.handle(JobClosed("a"), 1.0)
    assert s.budget("w0") == free_bytes(H100) - fp.base
    s.handle(JobClosed("b"), 2.0)
    assert s.budget("w0") == free_bytes(H100)


def test_a_full_fine_tune_holds_its_engine_while_open_and_a_second_does_not_fit_beside_it() -> None:
    """With engines that hold their memory while training, a second 1.7B full fine-tune's state
    fits nowhere beside the first's engine; with engines that sleep, it fits (its state taking
    turns with the first's on the device)."""
    s = Scheduler("plex")
    _worker(s, "w0", AWAKE_H100)
    full = JobShape(QWEN3_1_7B)
    fp = footprint(AWAKE_H100, full)
    assert s.handle(JobOpened("a", base="qwen3-1.7b", shape=full), 0.0) == [Place("a", "w0")]
    assert s.budget("w0") == free_bytes(AWAKE_H100) - fp.base - fp.pinned
    assert fp.base == fp.parts["base weights"] + fp.parts["activations"]
    (fail,) = s.handle(JobOpened("b", base="qwen3-1.7b", shape=full), 0.0)
    assert isinstance(fail, Fail) and isinstance(fail.error, JobTooLargeError)
    assert "engine:job:a" in str(fail.error)  # what holds the device

    s = Scheduler("plex")
    _worker(s, "w0", H100)
    assert s.handle(JobOpened("a", base="qwen3-1.7b", shape=full), 0.0) == [Place("a", "w0")]
    # The weights, and both engines or the activations, whichever is larger.
    parts = fp.parts
    assert s.budget("w0") == free_bytes(H100) - parts["base weights"] - max(parts["own engine"], parts["activations"])
    assert s.handle(JobOpened("b", base="qwen3-1.7b", shape=full), 0.0) == [Place("b", "w0")]
    assert s.budget("w0") == free_bytes(H100) - parts["base weights"] - 2 * parts["own engine"]
    assert s.used_bytes("w0") == fp.state  # b's state waits in host memory for a's to move out


def test_an_explicit_budget_caps_jobs_state_below_the_plans_room() -> None:
    s = Scheduler("plex")
    lora = JobShape(QWEN3_8B, lora_rank=8)
    state = footprint(H100, lora).state
    _worker(s, "w0", H100, memory_bytes=1.5 * state)
    s.handle(JobOpened("a", base="qwen3-8b", shape=lora), 0.0)
    s.handle(JobOpened("b", base="qwen3-8b", shape=lora), 0.0)
    assert s.budget("w0") == 1.5 * state and s.used_bytes("w0") == state  # b waits in host memory


def test_opening_a_job_beside_one_that_fills_the_budget_moves_that_one_out_first() -> None:
    s = Scheduler("fifo")
    lora = JobShape(QWEN3_8B, lora_rank=8)
    state = footprint(H100, lora).state
    _worker(s, "w0", H100, memory_bytes=1.5 * state)
    s.handle(JobOpened("a", base="qwen3-8b", shape=lora), 0.0)
    s.handle(JobOpened("b", base="qwen3-8b", shape=lora), 0.0)
    assert s.handle(CallSubmitted(1, "a", "open"), 0.0) == [Dispatch(1, "w0")]
    s.handle(CallFinished(1), 1.0)
    # b's open makes its state on the device: it needs the room a holds, sized before either opened.
    assert s.handle(CallSubmitted(2, "b", "open"), 2.0) == [Swap("a", "w0", "host", state)]


@pytest.mark.parametrize("rank", [8, 64])
def test_without_a_plan_the_scheduler_sizes_jobs_as_before(rank: int) -> None:
    s = Scheduler("plex")
    s.handle(WorkerJoined("w0", memory_bytes=100), 0.0)
    assert s.handle(JobOpened("a", state_bytes=60, shape=JobShape(QWEN3_8B, lora_rank=rank)), 0.0) == [Place("a", "w0")]
    assert s.used_bytes("w0") == 60 and s.budget("w0") == 100
