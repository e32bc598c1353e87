"""plexrl: run many RL jobs for LLMs on one shared set of accelerators.

A script stays an ordinary asyncio loop; its ``generate`` and ``optimize`` calls go to a
coordinator that time-slices workers between jobs. Importing plexrl never imports torch.

    async with plexrl.local(workers=1):
        async with plexrl.job("arith", model=path, lora=plexrl.LoRA(rank=8)) as job:
            out = await plexrl.generate(prompts, plexrl.SamplingParams(n=8, max_tokens=32))
            await plexrl.optimize(batch, loss="grpo")
            await job.sync_weights()
"""

from plexrl import errors
from plexrl.client.connection import Client, connect
from plexrl.client.job import Job, Optimized, forward_backward, generate, job, optim_step, optimize, sync_weights
from plexrl.client.local import LocalCluster, local
from plexrl.client.trajectory import Trajectory, Turn, prefix_cache_hit_rate
from plexrl.protocol.auth import Credentials
from plexrl.protocol.calls import (
    ForwardBackwardResult,
    Generated,
    Loaded,
    LogprobsResult,
    OptimStepResult,
    Saved,
    Synced,
)
from plexrl.rollout import group_advantages, grpo_batch, trajectory_batch
from plexrl.text import Renderer, Tokenizer
from plexrl.types import AdamW, Batch, LoRA, LossConfig, Ragged, Sample, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "AdamW",
    "Batch",
    "Client",
    "Credentials",
    "ForwardBackwardResult",
    "Generated",
    "Job",
    "Loaded",
    "LoRA",
    "LocalCluster",
    "LogprobsResult",
    "LossConfig",
    "OptimStepResult",
    "Optimized",
    "Ragged",
    "Renderer",
    "Sample",
    "SamplingParams",
    "Saved",
    "Synced",
    "Tokenizer",
    "Trajectory",
    "Turn",
    "connect",
    "errors",
    "forward_backward",
    "generate",
    "group_advantages",
    "grpo_batch",
    "job",
    "local",
    "optim_step",
    "optimize",
    "prefix_cache_hit_rate",
    "sync_weights",
    "trajectory_batch",
]
