"""GRPO's group-normalised advantages, and the training batch they go into."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from plexrl.errors import BatchShapeError
from plexrl.protocol.calls import Generated
from plexrl.types import Batch


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
