"""Client-side rollout pieces: group advantages and training batches from generated groups."""

from plexrl.rollout.advantages import group_advantages, grpo_batch

__all__ = ["group_advantages", "grpo_batch"]
