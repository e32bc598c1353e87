"""Pooled placement through real processes (Libra): a job trains on its home and its agent turns
run on the rollout workers, each turn in the bucket its trajectory's signals call for, and it
learns exactly as it does colocated, through a rollout worker's death and through its home being
lent to rollout and taken back."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import plexrl
from plexrl.client.connection import Client
from plexrl.models import TINY_MODEL, CharTokenizer
from plexrl.rollout import play, trajectory_batch, turn_params
from plexrl.rollout.agent import Tool
from plexrl.tasks import Problem, get_task
from plexrl.text import Renderer

TOK = Renderer(CharTokenizer())
SEARCH = get_task("search")
PROBLEMS = SEARCH.eval_set()[:6]
SPEC = {"model": TINY_MODEL, "lora": plexrl.LoRA(rank=4), "optimizer": plexrl.AdamW(lr=5e-2), "seed": 5}


async def _episodes(job: plexrl.Job, seed: int, tool: Tool | None = None) -> list[plexrl.Trajectory]:
    params = turn_params(SEARCH, TOK)
    return list(await asyncio.gather(*(play(job, SEARCH, p, params, TOK, seed=seed + 10 * i, tool=tool)
                                       for i, p in enumerate(PROBLEMS))))  # fmt: skip


Learned = tuple[list[list[plexrl.Trajectory]], list[plexrl.Batch]]


async def _steps(job: plexrl.Job, steps: int = 2) -> Learned:
    """GRPO steps of the search agent: what it sampled each step and what it trained on."""
    rollouts, batches = [], []
    for step in range(steps):
        trajs = await _episodes(job, seed=100 * step)
        rewards = [float(len(t.turns) % 2) for t in trajs]  # any reward that varies in the group
        batch = trajectory_batch(trajs, rewards, [0] * len(trajs))
        await job.optimize(batch, loss="grpo")
        await job.sync_weights()
        rollouts.append(trajs)
        batches.append(batch)
    return rollouts, batches


def _same_learning(a: Learned, b: Learned) -> None:
    for step, (trajs_a, trajs_b) in enumerate(zip(a[0], b[0], strict=True)):
        for ta, tb in zip(trajs_a, trajs_b, strict=True):
            assert [t.tokens.tolist() for t in ta.turns] == [t.tokens.tolist() for t in tb.turns]
            assert [t.weight_version for t in ta.turns] == [step] * len(ta.turns)
            assert [t.weight_version for t in tb.turns] == [step] * len(tb.turns)
    for ba, bb in zip(a[1], b[1], strict=True):
        np.testing.assert_array_equal(ba.tokens.values, bb.tokens.values)
        assert ba.loss_mask is not None and bb.loss_mask is not None
        assert ba.token_versions is not None and bb.token_versions is not None
        np.testing.assert_array_equal(ba.loss_mask.values, bb.loss_mask.values)
        np.testing.assert_array_equal(ba.token_versions.values, bb.token_versions.values)


def _bucket(traj: plexrl.Trajectory, k: int) -> int:
    """The bucket (0 or 1) of turn ``k`` by the coordinator's default queue (``Mlfq``): a level
    down for each tool error before it, and for tokens past half its budget (levels never go
    back up; no trajectory here takes 4 turns)."""
    budget = len(traj.prompt) + SEARCH.max_tokens
    errors = sum(t.tool_errors for t in traj.turns[:k])
    return int(errors > 0 or any(traj.turns[i].prompt_tokens >= 0.5 * budget for i in range(k + 1)))


async def _calls_by_worker(client: Client) -> dict[str, int]:
    return {w.name: w.calls_done for w in (await client.status()).workers}


@pytest.mark.asyncio
async def test_pooled_turns_run_in_their_buckets_and_the_job_learns_as_colocated() -> None:
    roles, buckets = ["train", "rollout", "rollout"], [0, 0, 1]
    # No trajectory moves down by its tokens against its peers' (this test predicts levels from each
    # trajectory alone) or by the service its turns received (that depends on this machine's speed).
    async with plexrl.local(workers=3, roles=roles, buckets=buckets, level_peers=(), level_service_s=()) as client:
        workers = {w.name: w for w in (await client.status()).workers}
        assert [(workers[f"local-{i}"].role, workers[f"local-{i}"].bucket) for i in range(3)] == list(
            zip(roles, buckets, strict=True)
        )
        async with plexrl.job("pooled", placement="pooled", **SPEC) as pooled:  # type: ignore[arg-type]
            before = await _calls_by_worker(client)
            learned_pooled = await _steps(pooled)
            after = await _calls_by_worker(client)
            # A turn of a trajectory whose search found nothing (a tool error) or that is past half
            # its token budget is a level down: bucket 1's, unless its one slot is taken (it spills
            # to bucket 0 then, never the other way); the home ran the training calls only.
            buckets_run = [_bucket(t, k) for step in learned_pooled[0] for t in step for k in range(len(t.turns))]
            assert 0 < sum(buckets_run) < len(buckets_run)
            on_1, on_2 = after["local-1"] - before["local-1"], after["local-2"] - before["local-2"]
            assert on_1 + on_2 == len(buckets_run)
            assert 0 < on_2 <= buckets_run.count(1)
            assert after["local-0"] - before["local-0"] == 2 * 3  # forward_backward, optim_step, sync_weights
            # A trajectory whose tool failed moves down a level: its next turn goes to bucket 1.
            traj = pooled.trajectory(TOK.prompt(PROBLEMS[0].prompt), max_turns=3)
            assert await traj.generate(turn_params(SEARCH, TOK)) is not None
            traj.observe(TOK.observation("<information>error</information>"), ok=False)
            second = await traj.generate(turn_params(SEARCH, TOK))
            assert second is not None and second.weight_version == 2
            moved = await _calls_by_worker(client)
            assert (moved["local-1"] - after["local-1"], moved["local-2"] - after["local-2"]) == (1, 1)
        async with plexrl.job("colocated", **SPEC) as colocated:  # type: ignore[arg-type]
            learned_colocated = await _steps(colocated)
    _same_learning(learned_pooled, learned_colocated)


@pytest.mark.asyncio
async def test_a_lost_rollout_workers_turns_run_again_on_another_and_nothing_is_lost() -> None:
    cluster = plexrl.local(
        workers=3, roles=["train", "rollout", "rollout"], heartbeat_interval_s=0.2, heartbeat_liveness=3
    )
    async with cluster as client, plexrl.job("pooled", placement="pooled", **SPEC) as job:  # type: ignore[arg-type]
        reference = await _episodes(job, seed=7)
        midway = asyncio.Event()
        answered = 0

        async def search(problem: Problem, response: str) -> str | None:
            nonlocal answered
            answered += 1
            if answered == 2:  # the first turns are back: the others run or wait on the rollout workers
                midway.set()
            return SEARCH.respond(problem, response)

        episodes = asyncio.ensure_future(_episodes(job, seed=7, tool=search))
        async with asyncio.timeout(60):
            await midway.wait()
        victim = cluster.worker_processes[1]
        victim.kill()
        cluster.reap(victim)
        async with asyncio.timeout(120):
            again = await episodes
        assert sorted(w.name for w in (await client.status()).workers) == ["local-0", "local-2"]
    for a, b in zip(reference, again, strict=True):  # every turn answered, the same tokens as before
        assert [t.tokens.tolist() for t in a.turns] == [t.tokens.tolist() for t in b.turns]
        assert a.stop_reason == b.stop_reason


@pytest.mark.asyncio
async def test_elastic_roles_go_both_ways_without_changing_what_is_learned() -> None:
    # A move (or a join) is expected to cost 10 ms until one is measured: from the second step on,
    # the home is lent to rollout while the job rolls out, and the rollout worker joins its training
    # (the first phases' lengths are not known before they end) at least once: once a join is
    # measured, the tiny model's short steps may not pay for another.
    async with plexrl.local(workers=2, roles=["train", "rollout"], elastic=True, move_prior_s=0.01) as client:
        async with plexrl.job("pooled", placement="pooled", **SPEC) as pooled:  # type: ignore[arg-type]
            learned_pooled = await _steps(pooled, steps=4)
            home, rollout = sorted((await client.status()).workers, key=lambda w: w.name)
            assert home.role == "train" and home.role_moves >= 2  # lent, and taken back for training
            assert rollout.role == "rollout" and rollout.joins >= 1  # joined its training, and left it
        async with plexrl.job("colocated", **SPEC) as colocated:  # type: ignore[arg-type]
            learned_colocated = await _steps(colocated, steps=4)
    _same_learning(learned_pooled, learned_colocated)
