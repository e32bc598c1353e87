"""GRPO's group-normalised advantages, and the training batches they go into (single-turn samples
or multi-turn trajectories)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from plexrl.client.trajectory import Trajectory
from plexrl.errors import BatchShapeError
from plexrl.protocol.calls import Generated
from plexrl.types import Batch, Ragged


def group_advantages(
    rewards_B: Sequence[float] | np.ndarray, prompt_index_B: np.ndarray, eps: float = 1e-6
) -> np.ndarray:
    """(r - mean of its group) / (std of its group + eps); a group is the samples of one prompt.

    A group whose rewards are all equal gets advantage 0 for every sample: it carries no signal.
    """
    r = np.asarray(rewards_B, dtype=np.float64)
    if r.shape != prompt_index_B.shape:
        raise BatchShapeError(
            f"got {r.shape[0] if r.ndim else 0} rewards for {len(prompt_index_B)} samples: give one per sample"
        )
    adv = np.zeros_like(r)
    for g in np.unique(prompt_index_B):
        members = prompt_index_B == g
        group = r[members]
        adv[members] = (group - group.mean()) / (group.std() + eps)
    return adv.astype(np.float32)


def grpo_batch(
    prompts: Sequence[Sequence[int] | np.ndarray], generated: Generated, rewards_B: Sequence[float] | np.ndarray
) -> Batch:
    """The training batch for ``loss="grpo"``: every sample with its group-normalised advantage."""
    advantages = group_advantages(rewards_B, generated.prompt_index_B)
    return Batch.from_samples(prompts, generated.samples, advantages)


def trajectory_batch(
    trajectories: Sequence[Trajectory], rewards_B: Sequence[float] | np.ndarray, group_B: Sequence[int] | np.ndarray
) -> Batch:
    """The ``grpo`` batch of multi-turn trajectories: one row per trajectory with a turn, its
    tokens exactly as the sampler saw them up to its last turn, observation tokens masked out of
    the loss, every sampled token's weight version. ``group_B`` names each trajectory's group
    (the trajectories of one prompt); advantages are normalised within it. A trajectory stopped
    before its first turn has nothing to train on, but its reward still counts in its group's
    baseline.
    """
    group = np.asarray(group_B, dtype=np.int64)
    if group.shape != (len(trajectories),):
        raise BatchShapeError(f"got {group.shape[0] if group.ndim else 0} group ids for {len(trajectories)} "
                              "trajectories: give one per trajectory")  # fmt: skip
    advantages = group_advantages(rewards_B, group)
    rows, prompt_lens, logps, masks, versions, kept = [], [], [], [], [], []
    for i, traj in enumerate(trajectories):
        if not traj.turns:
            continue
        kept.append(i)
        parts, lp, mask, ver = [traj.prompt], [], [], []
        for k, turn in enumerate(traj.turns):
            parts.append(turn.tokens)
            lp.append(turn.logprobs)
            mask.append(np.ones(len(turn.tokens), np.int8))
            ver.append(np.full(len(turn.tokens), turn.weight_version, np.int64))
            if k + 1 < len(traj.turns):  # the last turn's observation trains nothing: left out
                obs = turn.observation
                parts.append(obs)
                lp.append(np.zeros(len(obs), np.float32))
                mask.append(np.zeros(len(obs), np.int8))
                ver.append(np.full(len(obs), -1, np.int64))
        rows.append(np.concatenate(parts))
        prompt_lens.append(len(traj.prompt))
        logps.append(np.concatenate(lp))
        masks.append(np.concatenate(mask))
        versions.append(np.concatenate(ver))
    if not rows:
        raise BatchShapeError("no trajectory took a turn: there is nothing to train on")
    return Batch(
        tokens=Ragged.from_rows(rows, "int32"),
        prompt_lens_B=np.array(prompt_lens, np.int32),
        sampler_logprobs=Ragged.from_rows(logps, "float32"),
        advantages_B=advantages[kept],
        weight_versions_B=np.array([min(t.weight_version for t in trajectories[i].turns) for i in kept], np.int64),
        loss_mask=Ragged.from_rows(masks, "int8"),
        token_versions=Ragged.from_rows(versions, "int64"),
    )
