"""What a CPU engine and a CUDA engine differ in is configuration only (``vllm.by_device``), and the
calls the sampler makes are the installed vLLM's: checked against its real signatures, so the CPU
run (which cannot sleep) and the GPU run make the same calls. Sleep levels, which vLLM has on GPUs
only, are checked in order on a recording engine whose methods take AsyncLLM's parameters."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load, load_file

from plexrl.errors import InvalidRequestError
from plexrl.models import TINY_MODEL
from plexrl.worker.sampler import vllm as vllm_sampler

if not vllm_sampler.available():
    if os.environ.get("PLEXRL_REQUIRE_VLLM"):
        raise RuntimeError("PLEXRL_REQUIRE_VLLM is set but vLLM is not installed")
    pytest.skip("vLLM is not installed", allow_module_level=True)

from vllm.v1.engine.async_llm import AsyncLLM

from vllm import AsyncEngineArgs


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_every_device_argument_is_one_vllm_takes(device: str) -> None:
    _, args = vllm_sampler.by_device(device, vllm_sampler.VllmConfig())
    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    assert set(args) <= fields, set(args) - fields


def test_the_devices_differ_where_vllms_platforms_do_and_nowhere_else() -> None:
    config = vllm_sampler.VllmConfig()
    cpu_env, cpu = vllm_sampler.by_device("cpu", config)
    cuda_env, cuda = vllm_sampler.by_device("cuda:3", config)
    assert cuda["enable_sleep_mode"] and not cpu.get("enable_sleep_mode", False)
    assert cuda["gpu_memory_utilization"] == config.gpu_memory_utilization
    assert cpu_env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in cuda_env
    assert cpu_env["VLLM_CPU_KVCACHE_SPACE"] == str(config.kv_cache_gib)
    assert cpu["enable_chunked_prefill"] is False and "enable_chunked_prefill" not in cuda


# The AsyncLLM methods the sampler calls, and the parameters it passes by name.
CALLS = {
    "generate": {"prompt", "sampling_params", "request_id", "lora_request", "priority"},
    "add_lora": {"lora_request"},
    "remove_lora": {"lora_id"},
    "collective_rpc": {"method", "args"},
    "reset_prefix_cache": set(),
    "pause_generation": {"mode", "clear_cache"},
    "resume_generation": set(),
    "sleep": {"level", "mode"},
    "wake_up": {"tags"},
    "shutdown": set(),
}


@pytest.mark.parametrize("method", sorted(CALLS))
def test_the_sampler_calls_asyncllm_as_the_installed_vllm_defines_it(method: str) -> None:
    params = set(inspect.signature(getattr(AsyncLLM, method)).parameters)
    assert CALLS[method] <= params, CALLS[method] - params


class RecordingAsyncLLM:
    """Stands in for ``AsyncLLM`` where sleeping needs a GPU: records the calls the sampler makes.
    Its methods take AsyncLLM's own parameters (checked below), so it cannot drift from vLLM."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.asleep: set[str] = set()

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", level, mode))
        self.asleep = {"weights", "kv_cache"}

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tags))
        self.asleep -= set(tags or self.asleep)
        return not self.asleep

    async def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        self.calls.append(("collective_rpc", method, args))
        return [None]

    async def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return True


@pytest.mark.parametrize("method", ["sleep", "wake_up", "collective_rpc", "reset_prefix_cache"])
def test_the_recording_engine_takes_what_asyncllm_takes(method: str) -> None:
    fake = set(inspect.signature(getattr(RecordingAsyncLLM, method)).parameters)
    assert fake <= set(inspect.signature(getattr(AsyncLLM, method)).parameters)


@pytest.fixture
def gpu_sampler() -> Iterator[tuple[vllm_sampler.VllmSampler, RecordingAsyncLLM]]:
    """The sampler as it runs on a GPU (sleep mode on), over the recording engine."""
    sampler = object.__new__(vllm_sampler.VllmSampler)
    sampler.model_path, sampler.config = TINY_MODEL, vllm_sampler.VllmConfig()
    sampler._tied_head = True  # the tiny model ties its output layer to its embeddings
    sampler.sleep_mode, sampler.sleeping, sampler.restore = True, None, None
    sampler._loop = asyncio.new_event_loop()
    sampler._thread = threading.Thread(target=sampler._loop.run_forever, daemon=True)
    sampler._thread.start()
    sampler._engine = engine = RecordingAsyncLLM()
    try:
        yield sampler, engine
    finally:
        sampler._stop_loop()


def test_a_level_2_wake_loads_the_trainers_copy_between_the_weights_and_the_kv_cache(
    gpu_sampler: tuple[vllm_sampler.VllmSampler, RecordingAsyncLLM],
) -> None:
    sampler, engine = gpu_sampler
    trained = {k: v + 1.0 for k, v in load_file(str(Path(TINY_MODEL) / "model.safetensors")).items()}
    sampler.restore = lambda: trained
    sampler.sleep(2)
    assert engine.calls == [("sleep", 2, "keep")] and sampler.sleeping == 2
    assert not sampler.wake(["weights"])  # the KV cache still sleeps
    (woken, (_, method, (buckets,)), reset) = engine.calls[1:]
    assert woken == ("wake_up", ["weights"]) and method == "plexrl_reload_weights" and reset == ("reset_prefix_cache",)
    loaded = {k: v for bucket in buckets for k, v in load(bucket).items()}
    assert all(loaded[k].equal(t) for k, t in trained.items())  # the trainer's copy, not the checkpoint
    assert sampler.wake(["kv_cache"]) and sampler.sleeping is None
    assert engine.calls[-1] == ("wake_up", ["kv_cache"])


def test_a_level_1_wake_loads_nothing_and_level_2_needs_a_copy_to_load(
    gpu_sampler: tuple[vllm_sampler.VllmSampler, RecordingAsyncLLM],
) -> None:
    sampler, engine = gpu_sampler
    sampler.sleep(1)
    assert sampler.wake()
    assert engine.calls == [("sleep", 1, "keep"), ("wake_up", None)]
    with pytest.raises(InvalidRequestError, match="sleep at level 1"):
        sampler.sleep(2)
    assert len(engine.calls) == 2 and sampler.sleeping is None
