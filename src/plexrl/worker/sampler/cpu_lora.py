"""Multi-LoRA linear layers for vLLM on CPU, grouped by adapter (a vLLM plugin the worker enables).

vLLM's CPU LoRA ops (``vllm.lora.ops.torch_ops``) gather every token's adapter matrices
(``lora_b[indices]``: a ``[tokens, out, rank]`` copy per layer and projection) and multiply one
token at a time (``bench/lora_layers.py`` times both on the shipped model's shapes).
``GroupedPunicaWrapperCPU`` groups a step's tokens by adapter once and multiplies each adapter's
tokens together: a run of consecutive tokens of one adapter (a prompt's prefill) in place on its
slices of the input and output, then one batched matmul over the adapters with few tokens left
(each padded to a common width) and one matmul per adapter with many. A layer's slices (q/k/v,
gate/up) go through one shrink and one expand matmul, on weights combined per slot when vLLM puts
an adapter in the slot; an adapter's own matmuls use only the rank it has (vLLM pads every
adapter to ``max_lora_rank`` with zeros).
Same arithmetic (``y += scale * (x @ A.T) @ B.T`` per token), float32 like vLLM's buffers.
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


_vllms_own: Any = None  # vLLM's own CpuPlatform.get_punica_wrapper while this module's replaces it


def register() -> None:
    """vLLM plugin entry point (called as each engine starts): use ``GroupedPunicaWrapperCPU`` on
    the CPU platform if the worker asks (``PLEXRL_GROUPED_LORA=1``), else vLLM's own, even where an
    earlier engine of this process asked otherwise."""
    global _vllms_own
    if os.environ.get(ENV) != "1":
        if _vllms_own is not None:
            from vllm.platforms.cpu import CpuPlatform

            CpuPlatform.get_punica_wrapper = _vllms_own
            _vllms_own = None
        return
    from vllm.platforms.cpu import CpuPlatform

    if _vllms_own is None:
        _vllms_own = CpuPlatform.__dict__["get_punica_wrapper"]
    CpuPlatform.get_punica_wrapper = classmethod(lambda cls: f"{__name__}.GroupedPunicaWrapperCPU")


# What an adapter's own matmuls cost beyond its rows (four more ops, ~30 us), in padded rows of the
# batched matmul (~0.45 us each on the shipped model's q/k/v): measured with bench/lora_layers.py.
GROUP_COST_ROWS = 64
# A run of this many consecutive tokens of one adapter is multiplied in place (two matmuls on
# slices: no gather, no scatter, no padding). In a one-off replay (not shipped) of the steps one
# together run of bench/marlaas.py made (203 tokens a step on average, 70% of them in such runs),
# 8 and 16 cost the same and 32 more.
RUN_MIN = 16


@dataclass(frozen=True)
class TokenGroups:
    """A step's tokens grouped by adapter slot, made once per step for every layer.

    First the ``runs``: RUN_MIN or more consecutive tokens of one slot (a prefill's), taken as
    slices. Of the other tokens, the adapters with fewer share one batched matmul, each padded to ``width`` rows
    (group i's j-th token at row ``i * width + j``; ``source`` names the token feeding each padded
    row). The ones with more get matmuls of their own (``big``). Where the line falls is chosen
    per step to cost the least: padding every small adapter to the widest of them against
    ``GROUP_COST_ROWS`` per adapter taken out. The groups are the ``small`` slots' weights gathered
    (a copy per layer), or, when at least half the slots are small (``small`` None), every slot
    in place: group i is slot i, and the absent slots' rows are padding (cheaper than the copy).
    Padding rows compute on token 0 and are never added back: only real rows are (``rows`` into
    ``tokens``), so nothing computed on padding reaches a token, even from an adapter with
    non-finite weights. Tokens of slot -1 (no adapter) are in none of these.
    """

    small: Tensor | None  # [S] slots of the padded groups; None: every slot, in slot order
    width: int  # rows per padded group
    source: Tensor  # [groups * width] token index (0 for padding)
    rows: Tensor  # the padded row of each small group's token ...
    tokens: Tensor  # ... and that token
    big: tuple[tuple[int, Tensor], ...]  # (slot, its tokens)
    runs: tuple[tuple[int, int, int], ...]  # (slot, start, stop): RUN_MIN or more tokens in a row

    @staticmethod
    def of(indices: Tensor, num_slots: int) -> TokenGroups:
        runs: tuple[tuple[int, int, int], ...] = ()
        if len(indices) >= RUN_MIN:
            slot_of_run, lengths = torch.unique_consecutive(indices, return_counts=True)
            stops = torch.cumsum(lengths, 0)
            long = (lengths >= RUN_MIN) & (slot_of_run >= 0)
            if bool(long.any()):
                runs = tuple(zip(slot_of_run[long].tolist(), (stops - lengths)[long].tolist(), stops[long].tolist(),
                                 strict=True))  # fmt: skip
                indices = indices.clone()
                for _, start, stop in runs:
                    indices[start:stop] = -1  # the runs' tokens are in no group
        return TokenGroups._grouped(indices, num_slots, runs)

    @staticmethod
    def _grouped(indices: Tensor, num_slots: int, runs: tuple[tuple[int, int, int], ...]) -> TokenGroups:
        valid = torch.nonzero(indices >= 0).flatten()
        order = valid[torch.argsort(indices[valid], stable=True)]
        slot_of = indices[order]
        slots, counts = torch.unique_consecutive(slot_of, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        sizes = counts.tolist()
        # Taking out the j largest groups costs their rows plus GROUP_COST_ROWS each; the rest pad
        # to the (j+1)-th largest.
        by_size = sorted(sizes, reverse=True)
        costs = [sum(by_size[:j]) + j * GROUP_COST_ROWS + (len(sizes) - j) * (by_size[j] if j < len(sizes) else 0)
                 for j in range(len(sizes) + 1)]  # fmt: skip
        taken = min(range(len(costs)), key=costs.__getitem__)
        width = by_size[taken] if taken < len(sizes) else 0
        is_big = counts > width  # exactly the ``taken`` largest: a tie at the line would cost more
        big = tuple(
            (slot, order[start : start + count])
            for slot, start, count in zip(
                slots[is_big].tolist(), starts[is_big].tolist(), counts[is_big].tolist(), strict=True
            )
        )
        small_counts = counts[~is_big]
        if not len(small_counts):
            empty = torch.zeros(0, dtype=torch.long)
            return TokenGroups(empty, 0, empty, empty, empty, big, runs)
        in_place = 2 * len(small_counts) >= num_slots
        small = ~torch.repeat_interleave(is_big, counts)
        group_of_slot = slots if in_place else torch.cumsum(~is_big, 0) - 1
        group = torch.repeat_interleave(group_of_slot, counts)  # each token's padded group
        within = torch.arange(len(order)) - torch.repeat_interleave(starts, counts)
        rows = (group * width + within)[small]
        source = torch.zeros(((num_slots if in_place else len(small_counts)) * width,), dtype=torch.long)
        source[rows] = order[small]
        return TokenGroups(None if in_place else slots[~is_big], width, source, rows, order[small], big, runs)


class LayerWeights:
    """One LoRA layer's adapters, every slice at once: ``y += x @ shrink[s] @ expand[s]`` for slot s.

    ``shrink`` is every slice's A side by side ([slots, in, k * rank]); ``expand`` puts each
    slice's B (times the scale) in its own block of rows and columns ([slots, k * rank, sum of
    outs]), so one matmul expands every slice. ``load`` combines one slot from vLLM's stacked
    tensors (a free slot is zero: it may still hold a former adapter's weights). ``own`` is each
    slot's pair without the columns of ``shrink`` that are zero (the rank vLLM padded the adapter
    to, beyond its own: they add nothing) for the matmuls of one adapter's tokens; None: the slot
    adds nothing.
    """

    def __init__(self, lora_a: tuple[Tensor, ...], lora_b: tuple[Tensor, ...], scale: float) -> None:
        self.lora_a, self.lora_b, self.scale = lora_a, lora_b, scale
        self.rank = lora_a[0].shape[-2]
        self.outs = [b.shape[-2] for b in lora_b]
        slots, k = lora_a[0].shape[0], len(lora_a)
        self.shrink = torch.zeros((slots, lora_a[0].shape[-1], k * self.rank))
        self.expand = torch.zeros((slots, k * self.rank, sum(self.outs)))
        self.own: list[tuple[Tensor, Tensor] | None] = [None] * slots

    def load(self, slot: int, active: bool) -> None:
        self.shrink[slot] = 0
        self.expand[slot] = 0
        self.own[slot] = None
        if not active:
            return
        r, at = self.rank, 0
        for i, (a, b, out) in enumerate(zip(self.lora_a, self.lora_b, self.outs, strict=True)):
            self.shrink[slot, :, i * r : (i + 1) * r] = a[slot, 0].to(torch.float32).T
            self.expand[slot, i * r : (i + 1) * r, at : at + out] = b[slot, 0].to(torch.float32).T * self.scale
            at += out
        used = torch.nonzero((self.shrink[slot] != 0).any(0)).flatten()  # NaN is used: it must show
        if len(used):
            self.own[slot] = (self.shrink[slot][:, used].contiguous(), self.expand[slot][used].contiguous())


def grouped_lora_linear(y: Tensor, x: Tensor, weights: LayerWeights, groups: TokenGroups) -> None:
    """``y[t, :outs] += (x[t] @ shrink[s]) @ expand[s]`` for each token t of slot s."""
    x = x.to(torch.float32)
    cols = weights.expand.shape[-1]
    out = y[:, :cols]
    if groups.width:
        shrink, expand = weights.shrink, weights.expand
        if groups.small is not None:
            shrink, expand = shrink.index_select(0, groups.small), expand.index_select(0, groups.small)
        rows = x.index_select(0, groups.source).view(len(shrink), groups.width, -1)
        added = torch.bmm(torch.bmm(rows, shrink), expand).view(-1, cols)
        out.index_add_(0, groups.tokens, added.index_select(0, groups.rows).to(y.dtype))
    for slot, tokens in groups.big:
        if (own := weights.own[slot]) is not None:
            out.index_add_(0, tokens, (x.index_select(0, tokens) @ own[0] @ own[1]).to(y.dtype))
    for slot, start, stop in groups.runs:
        if (own := weights.own[slot]) is None:
            continue
        if y.dtype == torch.float32:
            out[start:stop].addmm_(x[start:stop] @ own[0], own[1])
        else:
            out[start:stop] += (x[start:stop] @ own[0] @ own[1]).to(y.dtype)


def _wrapper_class() -> type:
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    class Grouped(PunicaWrapperCPU):
        """vLLM's CPU punica wrapper with ``add_lora_linear`` grouped by adapter.

        Each layer's ``LayerWeights`` are kept, and a slot is combined again when its adapter
        changes: vLLM writes an adapter into a slot only when it activates it, and calls
        ``update_metadata`` (with every slot's adapter id) before the first step that uses it.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._groups: TokenGroups | None = None  # made on a step's first LoRA layer
            self._slots: list[int | None] | None = None  # each slot's adapter id, None: free
            self._layers: dict[int, LayerWeights] = {}  # by the layer's stacked lora_a

        def update_metadata(self, mapping: Any, lora_index_to_id: list[int | None], *args: Any, **kwargs: Any) -> None:
            super().update_metadata(mapping, lora_index_to_id, *args, **kwargs)
            self._groups = None
            old, self._slots = self._slots, list(lora_index_to_id)
            changed = [s for s, id_ in enumerate(self._slots) if old is None or old[s] != id_]
            for layer in self._layers.values():
                for s in changed:
                    layer.load(s, self._slots[s] is not None)

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
                self._groups = TokenGroups.of(indices, len(lora_a_stacked[0]))
            weights = self._layers.get(id(lora_a_stacked[0]))
            if weights is None:
                weights = self._layers[id(lora_a_stacked[0])] = LayerWeights(lora_a_stacked, lora_b_stacked, scale)
                for s in range(len(weights.shrink)):  # slots unknown (no update_metadata yet): all taken
                    weights.load(s, self._slots is None or (s < len(self._slots) and self._slots[s] is not None))
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
