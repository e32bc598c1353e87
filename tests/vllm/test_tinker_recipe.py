"""A real Tinker cookbook recipe, unmodified, through the gateway: two copies of
``tinker_cookbook.recipes.math_rl.train env=arithmetic`` on ``tiny-arith-chat`` under different API
keys at once, on one vLLM worker under ``plex``. Each must finish with its metrics and checkpoints
written and well-formed replies (ended at the renderer's stop sequence by the sampler) among its
samples; their training clients must be two plexrl jobs, one per key, open at the same time on
the one worker. And the ``chat`` task's prompts are exactly what the cookbook renders.

Needs ``tinker-cookbook==0.6.1`` (installed ``--no-deps`` with its needs by name: noxfile.py) and vLLM.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

import plexrl
from plexrl.gateway import running
from plexrl.gateway.service import Gateway
from plexrl.gateway.tenants import KeyedTenants
from plexrl.models import TINY_CHAT_MODEL, CharTokenizer
from plexrl.tasks import chat, get_task
from plexrl.worker.sampler import vllm as vllm_sampler

try:
    import tinker_cookbook  # noqa: F401
except ImportError:
    if os.environ.get("PLEXRL_REQUIRE_VLLM"):  # CI: everything installed, nothing skipped
        raise
    pytest.skip("tinker-cookbook is not installed (see noxfile.py)", allow_module_level=True)
if not vllm_sampler.available():
    if os.environ.get("PLEXRL_REQUIRE_VLLM"):
        raise RuntimeError("PLEXRL_REQUIRE_VLLM is set but vLLM is not installed")
    pytest.skip("vLLM is not installed", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

STEPS = 2
RECIPE_TIMEOUT_S = 420  # a cold start of the cookbook's imports is ~10 s; two steps take seconds


def recipe_args(url: str, log_path: Path) -> list[str]:
    """The recipe's command line: small settings, the shipped model's directory, an explicit renderer."""
    return [
        "-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={TINY_CHAT_MODEL}",
        "renderer_name=role_colon", "loss_fn=importance_sampling", "lora_rank=4", "group_size=4",
        "groups_per_batch=2", "learning_rate=1e-2", "max_tokens=12", f"max_steps={STEPS}", "eval_every=0",
        "save_every=1", "behavior_if_log_dir_exists=delete", f"base_url={url}", f"log_path={log_path}",
    ]  # fmt: skip


async def run_recipe(url: str, api_key: str, log_path: Path) -> tuple[int, str]:
    env = {**os.environ, "TINKER_API_KEY": api_key}
    process = await asyncio.create_subprocess_exec(
        sys.executable, *recipe_args(url, log_path), env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        async with asyncio.timeout(RECIPE_TIMEOUT_S):
            out, _ = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return process.returncode or 0, out.decode(errors="replace")[-4000:]


@pytest.mark.asyncio
async def test_two_cookbook_recipes_under_two_keys_share_one_worker_and_stay_apart(tmp_path: Path) -> None:
    cluster = plexrl.local(workers=1, sampler="vllm", policy="plex")
    async with cluster as client:
        assert cluster.keys is not None
        gateway = Gateway(KeyedTenants.issued(client.address, cluster.keys))  # as `plexrl tinker --local`
        jobs: dict[str, str] = {}  # owner -> its plexrl job
        tenants: dict[str, str] = {}  # owner -> its job's plexrl tenant
        both_open = asyncio.Event()
        create_model = gateway.create_model

        async def recorded(owner: str, request: dict[str, Any]) -> Any:
            # Neither recipe trains before the other's training client exists: they run at once.
            outcome = await create_model(owner, request)
            job = gateway.models[outcome.body["model_id"]].job
            jobs[owner] = job.job_id
            tenants[owner] = {j.job_id: j.owner for j in (await client.status()).jobs}[job.job_id]
            if len(jobs) == 2:
                both_open.set()
            async with asyncio.timeout(RECIPE_TIMEOUT_S):
                await both_open.wait()
            return outcome

        gateway.create_model = recorded  # type: ignore[method-assign]
        keys = {"tml-alice": tmp_path / "alice", "tml-bob": tmp_path / "bob"}
        async with running(gateway) as url:
            results = await asyncio.gather(*(run_recipe(url, key, path) for key, path in keys.items()))

    for (code, output), path in zip(results, keys.values(), strict=True):
        assert code == 0, output
        steps = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        rewards = [s["env/all/reward/total"] for s in steps if "env/all/reward/total" in s]
        assert len(rewards) == STEPS and all(-1.0 <= r <= 1.0 for r in rewards), steps
        assert max(s.get("env/all/format", 0.0) for s in steps) > 0, steps  # some replies end at "\n\nUser:"
        checkpoints = [json.loads(line) for line in (path / "checkpoints.jsonl").read_text().splitlines()]
        assert checkpoints[-1]["name"] == "final" and checkpoints[-1]["sampler_path"].startswith("tinker://")
    # One plexrl job per key, each of its own plexrl tenant (both open at once on the one worker).
    assert set(jobs) == set(keys) and len(set(jobs.values())) == 2 and len(set(tenants.values())) == 2
    assert gateway.models == {} and gateway.sessions == {}  # both recipes finished their sessions


def test_the_chat_tasks_prompts_are_what_the_cookbook_renders() -> None:
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    renderer = renderers.get_renderer("role_colon", tokenizer=get_tokenizer(TINY_CHAT_MODEL))
    assert renderer.get_stop_sequences() == [chat.STOP]
    for problem in get_task("chat").eval_set()[:20]:
        match = re.search(r"What is (\d+) \+ (\d+)\?\n\nAssistant:$", problem.prompt)
        assert match is not None, problem.prompt
        question = {"role": "user", "content": f"What is {match[1]} + {match[2]}?"}
        rendered = renderer.build_generation_prompt([*ArithmeticEnv.standard_fewshot_prefix(), question])
        assert rendered.to_ints() == CharTokenizer().encode(problem.prompt)
        env = ArithmeticEnv(int(match[1]), int(match[2]), renderer)
        assert env.check_answer(
            renderer.parse_response(CharTokenizer().encode(problem.answer, add_special_tokens=False))[0]["content"]
        )
