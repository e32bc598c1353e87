"""Full fine-tune weights of one job: a private trainable copy of the base in float32 (the master
weights the optimizer updates; forwards autocast to the compute dtype) and (with the hf sampler) a
sampler copy in the compute dtype.

The shared base stays frozen and untouched (it is the KL reference); ``sync_weights`` copies the
trainer copy's parameters into the sampler copy, or refits the job's own vLLM engine (then there
is no sampler copy here).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from plexrl.worker.gang import Gang
from plexrl.worker.models import BaseModel
from plexrl.worker.trainer.sharded import shard


class FullWeights:
    kind = "full"

    def __init__(self, base: BaseModel, sampler_copy: bool = True, gang: Gang | None = None) -> None:
        causal = base.copy().requires_grad_(True)
        # On a gang (a job on several workers), sharded over its members with FSDP2 (sharded.py).
        self.sharded = gang is not None
        self.trainer: Any = shard(causal, gang) if gang is not None else causal
        self.sampler: Any = base.copy(base.dtype).requires_grad_(False).eval() if sampler_copy else None
        # named_parameters() lists tied weights (embeddings / lm_head) once, under one name; a
        # sharded copy's are its shards under the same names (checkpoints move either way).
        self.trainer_params: dict[str, nn.Parameter] = dict(causal.named_parameters())
        self.sampler_params: dict[str, nn.Parameter] = (
            {} if self.sampler is None else dict(self.sampler.named_parameters())
        )
        self.total_params = sum(p.numel() for p in self.trainer_params.values())

    def trainer_model(self, train: bool) -> nn.Module:
        return self.trainer.train(train)

    def sampler_model(self) -> nn.Module:
        if self.sampler is None:
            raise RuntimeError("this job samples on vLLM: it has no hf sampler copy")
        return self.sampler.eval()

    def adapter_config(self) -> Any:
        raise TypeError("full fine-tune jobs have no adapter")

    def close(self) -> None:
        self.trainer = self.sampler = None
        self.trainer_params = {}
        self.sampler_params = {}
