"""Full fine-tune weights sharded over a gang with FSDP2: each member holds 1/N of the trainer's
float32 masters, their gradients and (so) AdamW's moments.

Each decoder layer is a ``fully_shard`` unit (its weights gathered for its forward and again
for its backward, then freed), and so is the root (``ShardedRoot``: the embeddings, final norm
and output layer, tied or not). Gradients are reduce-scattered as means over the members (gloo
has no pre-scaled sum), which the trainer turns back into sums at ``optim_step`` before it
divides by the step's token count, as on one worker. Forwards autocast to the compute dtype as on
one worker, so a gang computes what one worker would, up to the order of its sums.

The sampler copy (hf sampler) is whole on every member and the frozen base (the KL reference)
too: on a GPU gang only the leader samples, so the others' copies are memory a later change
frees.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import fully_shard

from plexrl.worker.gang import Gang
from plexrl.worker.models import BaseModel
from plexrl.worker.trainer.forward import ShardedRoot


class ShardedWeights:
    kind = "full"
    sharded = True

    def __init__(self, base: BaseModel, gang: Gang, sampler_copy: bool = True) -> None:
        causal = base.copy().requires_grad_(True)
        mesh = gang.mesh()
        for layer in causal.get_decoder().layers:
            fully_shard(layer, mesh=mesh)
        self.trainer: Any = fully_shard(ShardedRoot(causal), mesh=mesh)
        self.world = gang.world
        self.sampler: Any = base.copy(base.dtype).requires_grad_(False).eval() if sampler_copy else None
        # Same names as FullWeights' (the causal LM's): checkpoints and snapshots move between the two.
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
