"""Multi-LoRA linear layers for vLLM on CPU, grouped by adapter (a vLLM plugin the worker enables).

vLLM's CPU LoRA ops (``vllm.lora.ops.torch_ops``) gather every token's adapter matrices
(``lora_b[indices]``: a ``[tokens, out, rank]`` copy per layer and projection) and multiply one
token at a time (``bench/lora_layers.py`` times both on the shipped model's shapes).
``GroupedPunicaWrapperCPU`` groups a step's tokens by adapter once and multiplies each adapter's
tokens together: one batched matmul over the adapters with few tokens (padded to the largest of
them, laid out by slot so the weights are views, not copies) and one matmul per adapter with
many. A layer's slices (q/k/v, gate/up) go through one shrink and one expand matmul on weights
combined once per change of vLLM's adapter slots. Same arithmetic (``y += scale * (x @ A.T) @
B.T`` per token), float32 like vLLM's buffers.
A token without an adapter (index -1) gets nothing added, as on vLLM's GPU kernels (the CPU
ops index slot -1, the last adapter's).

vLLM loads ``register`` in each of its processes (the ``vllm.general_plugins`` entry point);
it takes effect only where ``PLEXRL_GROUPED_LORA=1``, which the worker sets for its engine, so
other vLLM programs in the same environment keep vLLM's own ops.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

ENV = "PLEXRL_GROUPED_LORA"


def register() -> None:
    """vLLM plugin entry point: use ``GroupedPunicaWrapperCPU`` on the CPU platform."""
    if os.environ.get(ENV) != "1":
        return
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.get_punica_wrapper = classmethod(lambda cls: f"{__name__}.GroupedPunicaWrapperCPU")


@dataclass(frozen=True)
class TokenGroups:
    """A step's tokens grouped by adapter slot, made once per step for every layer.

    Adapters with few tokens share one batched matmul: their tokens are laid out by slot in
    ``(hi - lo + 1) x width`` padded rows (slot ``s``'s i-th token at row ``(s - lo) * width + i``),
    so each slot's weights are a view of the stacked ones, never gathered. ``source`` names the
    token feeding each padded row (``n``, a zero row, for padding); only real rows are added back
    (``rows`` into ``tokens``), so nothing computed on padding reaches a token, even from an
    adapter with non-finite weights. An adapter holding more than twice
    the mean tokens per adapter gets matmuls of its own (``big``), so one busy tenant does not
    pad every other to its size. Tokens of slot -1 (no adapter) are in neither.
    """

    lo: int  # first slot of the padded rows
    slots: int  # slots lo .. lo + slots - 1 are padded (0: no small group)
    width: int  # rows per slot
    source: Tensor  # [slots * width] token index, n for padding
    rows: Tensor  # the padded row of each small group's token ...
    tokens: Tensor  # ... and that token
    big: tuple[tuple[int, Tensor], ...]  # (slot, its tokens)

    @staticmethod
    def of(indices: Tensor) -> TokenGroups:
        n = len(indices)
        valid = torch.nonzero(indices >= 0).flatten()
        order = valid[torch.argsort(indices[valid], stable=True)]
        slot_of = indices[order]
        slots, counts = torch.unique_consecutive(slot_of, return_counts=True)
        cap = max(1, 2 * len(order) // max(1, len(slots)))  # above twice the mean, a group is big
        is_big = counts > cap
        starts = torch.cumsum(counts, 0) - counts
        big = tuple(
            (slot, order[start : start + count])
            for slot, start, count in zip(
                slots[is_big].tolist(), starts[is_big].tolist(), counts[is_big].tolist(), strict=True
            )
        )
        small_slots = slots[~is_big]
        if not len(small_slots):
            empty = torch.zeros(0, dtype=torch.long)
            return TokenGroups(0, 0, 0, empty, empty, empty, big)
        lo, hi = int(small_slots.min()), int(small_slots.max())
        width = int(counts[~is_big].max())
        small = ~torch.repeat_interleave(is_big, counts)
        within = torch.arange(len(order)) - torch.repeat_interleave(starts, counts)
        rows = ((slot_of - lo) * width + within)[small]
        source = torch.full(((hi - lo + 1) * width,), n, dtype=torch.long)
        source[rows] = order[small]
        return TokenGroups(lo, hi - lo + 1, width, source, rows, order[small], big)


@dataclass(frozen=True)
class LayerWeights:
    """One LoRA layer's adapters, all slices at once: ``y += x @ shrink[s] @ expand[s]`` for slot s.

    ``shrink`` is every slice's A side by side ([slots, in, k * rank]); ``expand`` puts each
    slice's B (times the scale) in its own block of rows and columns ([slots, k * rank, sum of
    outs]), so one matmul expands every slice. Slots without an adapter are zero.
    """

    shrink: Tensor
    expand: Tensor

    @staticmethod
    def of(lora_a: tuple[Tensor, ...], lora_b: tuple[Tensor, ...], scale: float, active: Tensor | None) -> LayerWeights:
        rank = lora_a[0].shape[-2]
        shrink = torch.cat([a[:, 0].to(torch.float32) for a in lora_a], dim=1).transpose(1, 2).contiguous()
        outs = [b.shape[-2] for b in lora_b]
        expand = shrink.new_zeros((shrink.shape[0], rank * len(lora_b), sum(outs)))
        at = 0
        for i, (b, out) in enumerate(zip(lora_b, outs, strict=True)):
            expand[:, i * rank : (i + 1) * rank, at : at + out] = b[:, 0].to(torch.float32).transpose(1, 2) * scale
            at += out
        # A free slot may hold a former adapter's weights: zeroed, so it adds nothing (as on vLLM's kernels).
        if active is not None and len(active) == len(shrink):
            shrink[~active] = 0
            expand[~active] = 0
        return LayerWeights(shrink, expand)


def grouped_lora_linear(y: Tensor, x: Tensor, weights: LayerWeights, groups: TokenGroups) -> None:
    """``y[t, :outs] += (x[t] @ shrink[s]) @ expand[s]`` for each token t of slot s."""
    x = x.to(torch.float32)
    cols = weights.expand.shape[-1]
    out = y[:, :cols]
    if groups.slots:
        rows = torch.cat([x, x.new_zeros((1, x.shape[1]))]).index_select(0, groups.source)
        window = slice(groups.lo, groups.lo + groups.slots)
        shrunk = torch.bmm(rows.view(groups.slots, groups.width, -1), weights.shrink[window])
        added = torch.bmm(shrunk, weights.expand[window]).view(-1, cols)
        out.index_add_(0, groups.tokens, added.index_select(0, groups.rows).to(y.dtype))
    for slot, tokens in groups.big:
        added = x.index_select(0, tokens) @ weights.shrink[slot] @ weights.expand[slot]
        out.index_add_(0, tokens, added.to(y.dtype))


def _wrapper_class() -> type:
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    class Grouped(PunicaWrapperCPU):
        """vLLM's CPU punica wrapper with ``add_lora_linear`` grouped by adapter.

        Each layer's ``LayerWeights`` are kept until the slots change: vLLM writes an adapter
        into a slot only when it activates it, and calls ``update_metadata`` (with the slots'
        adapter ids) before the first step that uses it.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._groups: TokenGroups | None = None  # made on a step's first LoRA layer
            self._slots: tuple[int | None, ...] | None = None  # each slot's adapter id, None: free
            self._layers: dict[int, LayerWeights] = {}  # by the layer's stacked lora_a

        def update_metadata(self, mapping: Any, lora_index_to_id: list[int | None], *args: Any, **kwargs: Any) -> None:
            super().update_metadata(mapping, lora_index_to_id, *args, **kwargs)
            self._groups = None
            if tuple(lora_index_to_id) != self._slots:
                self._slots = tuple(lora_index_to_id)
                self._layers = {}

        def add_lora_linear(
            self,
            y: Tensor,
            x: Tensor,
            lora_a_stacked: tuple[Tensor, ...],
            lora_b_stacked: tuple[Tensor, ...],
            scale: float,
            output_slices: tuple[int, ...],
            *,
            buffer: Any = None,
            **kwargs: Any,
        ) -> None:
            indices = self.token_lora_indices
            flat_y, flat_x = y.view(-1, y.shape[-1]), x.view(-1, x.shape[-1])
            if flat_x.shape[0] != indices.shape[0] or tuple(b.shape[-2] for b in lora_b_stacked) != tuple(
                output_slices
            ):
                return super().add_lora_linear(
                    y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer, **kwargs
                )  # a layout these groups do not cover: vLLM's own ops
            if self._groups is None:
                self._groups = TokenGroups.of(indices)
            weights = self._layers.get(id(lora_a_stacked[0]))
            if weights is None:
                active = None if self._slots is None else torch.tensor([s is not None for s in self._slots])
                weights = self._layers[id(lora_a_stacked[0])] = LayerWeights.of(
                    lora_a_stacked, lora_b_stacked, scale, active
                )
            grouped_lora_linear(flat_y, flat_x, weights, self._groups)

    Grouped.__name__ = Grouped.__qualname__ = "GroupedPunicaWrapperCPU"
    return Grouped


def __getattr__(name: str) -> Any:
    # Made on first use, so importing this module (the plugin) does not import vLLM.
    if name == "GroupedPunicaWrapperCPU":
        cls = _wrapper_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
