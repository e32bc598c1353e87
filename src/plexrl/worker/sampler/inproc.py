"""vLLM's ``LLMEngine`` stepped on the sampler's own event loop: the part of ``AsyncLLM``'s interface
the sampler uses, without AsyncLLM's engine-core process (the CPU sampler's engine).

On CPU a worker is one core, so vLLM's engine-core process computed on the same core as the worker
and every step's outputs crossed a socket to it: msgpack on both sides, a front-end thread and
context switches (bench/marlaas.py's together mode, profiled: about 12% of the worker's samples). Here the
engine core lives in the worker (vLLM's ``InprocClient``) and ``InProcessEngine`` steps it on the
sampler's loop between the loop's other work: a request is a future that a step completes, and
adapters, reloads and prefix-cache resets run between steps, never during one. Pausing is not
stepping (requests stay where they are, KV kept), which is all vLLM offers on CPU anyway.

Engines in one process step one at a time, and never inside a seeded block of the trainer
(``models.TORCH_GLOBALS``): vLLM keeps a step's forward context in a module global, so two
forwards on two threads would read each other's, and its CPU sampler draws from torch's default
RNG every step, which would make a job's initial adapter depend on when it opened. On one core
nothing runs in parallel anyway. On CUDA the sampler keeps ``AsyncLLM`` (sleep mode needs its allocator, one
per process, and the GPU overlaps the front-end's work). What vLLM's CPU worker does to its
process now happens to the worker's: ``torch.set_num_threads`` becomes a no-op (the worker sets
its threads at start, before any engine) and the objects alive at engine start are frozen out of
the garbage collector's scans (``gc.freeze``) until an engine shuts down.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from plexrl.errors import SamplerUnavailableError
from plexrl.worker.models import TORCH_GLOBALS
from plexrl.worker.progress import Progress

_live = 0  # engines of this process not shut down (under TORCH_GLOBALS)


class InProcessEngine:
    """An in-process ``LLMEngine`` driven from one asyncio loop; every method runs on that loop."""

    def __init__(self, engine: Any, progress: Progress) -> None:
        self._engine: Any = engine
        self._progress = progress
        self._waiting: dict[str, asyncio.Future[Any]] = {}  # request id -> its final output
        self._work = asyncio.Event()  # set when there may be something to step
        self._paused = False
        self._failed: SamplerUnavailableError | None = None
        self._driver = asyncio.get_running_loop().create_task(self._drive(), name="plexrl-vllm-steps")

    @classmethod
    def from_engine_args(cls, args: Any, progress: Progress) -> InProcessEngine:
        """Build the engine (call on the loop that will drive it)."""
        from vllm.v1.engine.llm_engine import LLMEngine

        global _live
        with TORCH_GLOBALS:
            engine = LLMEngine.from_engine_args(args, enable_multiprocessing=False)
            _live += 1
        return cls(engine, progress)

    # -- requests ----------------------------------------------------------------------------------

    async def generate(
        self, prompt: dict[str, Any], params: Any, request_id: str, *, lora_request: Any = None, priority: int = 0
    ) -> AsyncIterator[Any]:
        """The request's final output (its params' ``output_kind`` must be ``FINAL_ONLY``)."""
        self._check_alive()
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = done
        try:
            self._engine.add_request(request_id, prompt, params, lora_request=lora_request, priority=priority)
        except BaseException:
            del self._waiting[request_id]
            raise
        self._work.set()
        try:
            yield await done
        finally:
            if not done.done() and self._failed is None:  # the caller gave up: the request goes too
                self._waiting.pop(request_id, None)
                self._engine.abort_request([request_id])

    async def _drive(self) -> None:
        """Step while requests are unfinished and stepping is not paused; sleep on ``_work`` otherwise."""
        while True:
            if self._paused or not self._engine.has_unfinished_requests():
                self._work.clear()
                await self._work.wait()
                continue
            try:
                with TORCH_GLOBALS:
                    outputs = self._engine.step()
            except Exception as e:
                failed = SamplerUnavailableError(f"the vLLM engine failed ({type(e).__name__}: {e})")
                failed.__cause__ = e
                self._fail(failed)
                return
            self._progress.tick()
            for out in outputs:
                if out.finished and (done := self._waiting.pop(out.request_id, None)) and not done.done():
                    done.set_result(out)
            await asyncio.sleep(0)  # what came in during the step (requests, adapters) runs now

    def _fail(self, error: SamplerUnavailableError) -> None:
        """From now on every request and call raises ``error``; those waiting get it now."""
        self._failed = error
        for done in self._waiting.values():
            if not done.done():
                done.set_exception(error)
        self._waiting.clear()

    def _check_alive(self) -> None:
        if self._failed is not None:
            raise self._failed

    # -- between steps -----------------------------------------------------------------------------

    async def _between_steps(self, call: Callable[[], Any]) -> Any:
        self._check_alive()
        with TORCH_GLOBALS:
            return call()

    async def add_lora(self, request: Any) -> bool:
        return bool(await self._between_steps(lambda: self._engine.add_lora(request)))

    async def remove_lora(self, lora_id: int) -> bool:
        return bool(await self._between_steps(lambda: self._engine.remove_lora(lora_id)))

    async def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return list(await self._between_steps(lambda: self._engine.collective_rpc(method, args=args, kwargs=kwargs)))

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._between_steps(self._engine.reset_prefix_cache))

    async def pause_generation(self, mode: str = "keep", clear_cache: bool = False) -> None:
        """Stop stepping: requests in flight stay in place with their KV (``mode="keep"`` only)."""
        if mode != "keep" or clear_cache:
            raise ValueError("the in-process engine pauses only in place (mode='keep', clear_cache=False)")
        self._paused = True

    async def resume_generation(self) -> None:
        self._paused = False
        self._work.set()

    def shutdown(self) -> None:
        """Stop stepping, fail what is still waiting, and free the engine (on the driving loop)."""
        if self._engine is None:
            return
        self._driver.cancel()
        self._fail(self._failed or SamplerUnavailableError("the vLLM engine is shut down"))
        engine, self._engine = self._engine, None
        global _live
        with TORCH_GLOBALS:
            _live -= 1
            _shutdown(engine.engine_core, last=_live == 0)


def _shutdown(client: Any, last: bool) -> None:
    """Shut an ``InprocClient``'s engine core down. vLLM's ``EngineCore.shutdown`` ends by tearing
    down the process's distributed state (its parallel groups), which every other engine of the
    process still steps with: unless this is the last engine, the core's own parts go alone."""
    if last:
        client.shutdown()
        return
    client._finalizer.detach()  # it would run the full shutdown when the client is collected
    core = client.engine_core
    core.structured_output_manager.clear_backend()
    core.model_executor.shutdown()
    core.scheduler.shutdown()
