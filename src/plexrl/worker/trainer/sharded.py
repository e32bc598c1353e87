"""A full fine-tune's trainer copy sharded over a gang with FSDP2 (``FullWeights(..., gang=)``): each member holds 1/N of the trainer's
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
from plexrl.worker.trainer.forward import ShardedRoot


def shard(causal: nn.Module, gang: Gang) -> Any:
    """``causal`` sharded in place over ``gang``: each decoder layer a unit, and the root around
    it (what the trainer calls); its parameters become this member's shards (DTensors), under
    the same names."""
    mesh = gang.mesh()
    for layer in causal.get_decoder().layers:  # type: ignore[operator]
        fully_shard(layer, mesh=mesh)
    return fully_shard(ShardedRoot(causal), mesh=mesh)
