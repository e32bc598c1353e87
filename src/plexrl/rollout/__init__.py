"""Client-side rollout pieces: group advantages, training batches, and complete-group pipelining."""

from plexrl.rollout.advantages import group_advantages, grpo_batch, trajectory_batch
from plexrl.rollout.pipeline import Group, Rollout, RolloutMetrics, train
from plexrl.rollout.staleness import StalenessGate

__all__ = [
    "Group",
    "Rollout",
    "RolloutMetrics",
    "StalenessGate",
    "group_advantages",
    "grpo_batch",
    "train",
    "trajectory_batch",
]
