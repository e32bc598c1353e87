"""State transitions on a worker: real copies between the device store and the host store."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
from test_engine import (  # the engine tests' helpers (pytest puts tests/worker on sys.path)
    assert_same_weights,
    ce_batch,
    full_spec,
    generate,
    grpo_batch,
    lora_spec,
    rows,
    saved_weights,
)

from plexrl.errors import InvalidRequestError, UnknownJobError
from plexrl.plan import JobShape, ModelShape, footprint
from plexrl.protocol.calls import Close, ForwardBackward, JobSpec, Open, Opened, OptimStep, SyncWeights
from plexrl.types import LoRA
from plexrl.worker.engine import Engine
from plexrl.worker.memory import DEVICE, HOST, planned_state_bytes, state_refs
from plexrl.worker.trainer.forward import TrainerSettings

pytestmark = pytest.mark.usefixtures("one_thread")


def snapshot(engine: Engine, job_id: str) -> dict[str, np.ndarray]:
    job = engine._jobs[job_id]
    out = {}
    for key, ref in state_refs(job).items():
        t = ref.get()
        if t is not None:
            out[key] = t.detach().clone().numpy()
    return out


@pytest.mark.parametrize("spec", [lora_spec, full_spec])
def test_moving_out_frees_every_state_tensor_and_moving_in_restores_it_exactly(tiny_model: Path, spec) -> None:  # type: ignore[no-untyped-def]
    engine = Engine()
    engine.execute("a", Open(spec(tiny_model)))
    engine.execute("a", ForwardBackward(ce_batch(), loss="cross_entropy"))
    engine.execute("a", OptimStep())
    engine.execute("a", ForwardBackward(ce_batch(), loss="cross_entropy"))  # gradients pending too
    before = snapshot(engine, "a")
    assert any(k.startswith("optim/") for k in before) and any(k.startswith("grad/") for k in before)

    out = engine.move("a", HOST)
    job = engine._jobs["a"]
    assert job.host_state is not None and set(job.host_state) == set(before)
    assert out.to == HOST and out.bytes == sum(a.nbytes for a in before.values()) and out.seconds > 0
    for key, ref in state_refs(job).items():
        t = ref.get()
        assert t is None or t.numel() == 0, f"{key} still holds {t.numel()} elements on the device"

    back = engine.move("a", DEVICE)
    assert back.to == DEVICE and back.bytes == out.bytes and job.host_state is None
    after = snapshot(engine, "a")
    assert after.keys() == before.keys()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)


def test_a_job_moved_out_and_in_around_every_call_trains_exactly_like_one_never_moved(
    tiny_model: Path, tmp_path: Path
) -> None:
    moved, still = Engine(), Engine()
    for engine in (moved, still):
        engine.execute("a", Open(lora_spec(tiny_model)))
        engine.execute("b", Open(lora_spec(tiny_model, seed=1)))  # a neighbour on the shared base
    for _ in range(3):
        for engine in (moved, still):
            batch = grpo_batch(engine, "a")
            engine.execute("a", ForwardBackward(batch, loss="grpo"))
            if engine is moved:
                engine.move("a", HOST)
                engine.execute("b", ForwardBackward(ce_batch(), loss="cross_entropy"))  # b runs meanwhile
                engine.execute("b", OptimStep())
                engine.move("a", DEVICE)
            engine.execute("a", OptimStep())
            engine.execute("a", SyncWeights())
    assert rows(generate(moved, "a", n=2, max_tokens=6).tokens) == rows(generate(still, "a", n=2, max_tokens=6).tokens)
    assert_same_weights(saved_weights(moved, "a", tmp_path / "moved"), saved_weights(still, "a", tmp_path / "still"))


def test_a_call_on_state_left_in_the_host_store_moves_it_in_first(tiny_model: Path) -> None:
    engine = Engine()
    engine.execute("a", Open(lora_spec(tiny_model)))
    expected = rows(generate(engine, "a", n=2, max_tokens=6, seed=3).tokens)
    engine.move("a", HOST)
    assert rows(generate(engine, "a", n=2, max_tokens=6, seed=3).tokens) == expected
    assert engine._jobs["a"].host_state is None


def test_opened_reports_the_planned_state_size_and_close_works_from_the_host_store(tiny_model: Path) -> None:
    engine = Engine()
    opened = engine.execute("a", Open(lora_spec(tiny_model)))
    assert isinstance(opened, Opened)
    job = engine._jobs["a"]
    adapter = sum(p.numel() * 4 for p in job.weights.trainer_params.values())
    assert opened.state_bytes == planned_state_bytes(job) == 5 * adapter  # weights, grads, 2 moments, sampler
    engine.move("a", HOST)
    engine.execute("a", Close())
    assert engine.job_ids() == []


@pytest.mark.parametrize("sampler_copy", [True, False], ids=["hf", "vllm"])
@pytest.mark.parametrize("lora", [LoRA(rank=4, target_modules=("q_proj", "v_proj")), None], ids=["lora", "full"])
def test_the_plan_sizes_a_job_from_its_config_as_the_worker_measures_it(
    tiny_model: Path, lora: LoRA | None, sampler_copy: bool
) -> None:
    engine = Engine()
    opened = engine.execute("a", Open(JobSpec(model=str(tiny_model), lora=lora)))
    assert isinstance(opened, Opened)
    job = engine._jobs["a"]
    model = ModelShape.read(tiny_model)
    assert model is not None and model.params == job.base.num_params
    shape = JobShape(model) if lora is None else JobShape(model, lora.rank, lora.target_modules)
    assert shape.trained_params == opened.trainable_params
    # With vLLM sampling there is no sampler copy on the worker: its plan has no hf sampler.
    plan = msgspec.structs.replace(engine.plan(), sampler="hf" if sampler_copy else "vllm")
    measured = planned_state_bytes(job) - (0 if sampler_copy else sum(
        p.numel() * p.element_size() for p in job.weights.sampler_params.values()
    ))  # fmt: skip
    assert footprint(plan, shape).state == measured


def test_the_qwen3_shaped_model_has_the_parameters_its_plan_counts(qwen3_shaped_model: Path) -> None:
    engine = Engine(trainer=TrainerSettings(dtype="bfloat16"))
    opened = engine.execute("a", Open(JobSpec(model=str(qwen3_shaped_model), lora=LoRA(rank=8))))
    assert isinstance(opened, Opened)
    model = ModelShape.read(qwen3_shaped_model)
    assert model is not None and model.params == engine._jobs["a"].base.num_params
    assert model.vocab == 151936 and model.head_dim == 128 and model.tied and model.qk_norm
    assert JobShape(model, 8).trained_params == opened.trainable_params


def test_moves_of_unknown_jobs_or_to_unknown_tiers_are_rejected(tiny_model: Path) -> None:
    engine = Engine()
    with pytest.raises(UnknownJobError):
        engine.move("nope", HOST)
    engine.execute("a", Open(lora_spec(tiny_model)))
    with pytest.raises(InvalidRequestError, match=r"device.*host"):
        engine.move("a", "disk")
