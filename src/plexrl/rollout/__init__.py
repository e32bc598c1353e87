"""Client-side rollout pieces: agent episodes, group advantages, training batches, complete-group pipelining."""

from plexrl.rollout.advantages import group_advantages, grpo_batch, trajectory_batch
from plexrl.rollout.agent import Tool, completion, play, turn_params
from plexrl.rollout.asynchronous import AsyncStep, train_async
from plexrl.rollout.pipeline import Group, Rollout, RolloutMetrics, train
from plexrl.rollout.staleness import StalenessGate

__all__ = [
    "AsyncStep",
    "Group",
    "Rollout",
    "RolloutMetrics",
    "StalenessGate",
    "Tool",
    "completion",
    "group_advantages",
    "grpo_batch",
    "play",
    "train",
    "train_async",
    "trajectory_batch",
    "turn_params",
]
