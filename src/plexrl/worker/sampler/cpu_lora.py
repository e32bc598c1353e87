"""Multi-LoRA linear layers for vLLM on CPU, grouped by adapter (a vLLM plugin the worker enables).

vLLM's CPU LoRA ops (``vllm.lora.ops.torch_ops``) gather every token's adapter matrices
(``lora_b[indices]``: a ``[tokens, out, rank]`` copy per layer and projection) and multiply one
token at a time (``bench/lora_layers.py`` times both on the shipped model's shapes).
``GroupedPunicaWrapperCPU`` sorts a step's tokens
by adapter once and multiplies each adapter's tokens together: one batched matmul over the
adapters with few tokens (padded to the largest of them) and one matmul per adapter with many.
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


def register() -> None:
    """vLLM plugin entry point: use ``GroupedPunicaWrapperCPU`` on the CPU platform."""
    if os.environ.get(ENV) != "1":
        return
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.get_punica_wrapper = classmethod(lambda cls: f"{__name__}.GroupedPunicaWrapperCPU")


@dataclass(frozen=True)
class TokenGroups:
    """A step's tokens grouped by adapter slot: ``order`` sorts the tokens that have an adapter
    by slot; the first ``len(small)`` groups are padded to ``width`` rows for one batched
    matmul (``slots[flat]`` places them), the ``big`` ones get a matmul each."""

    order: Tensor  # [n] token positions, sorted by slot (tokens with slot -1 left out)
    small: Tensor  # [S] slots of the padded groups
    width: int  # rows per padded group
    flat: Tensor  # [n_small] row of each of the small groups' tokens in the [S * width] padding
    big: tuple[tuple[int, int, int], ...]  # (slot, start, end) into ``order``

    @staticmethod
    def of(indices: Tensor) -> TokenGroups:
        valid = torch.nonzero(indices >= 0).flatten()
        order = valid[torch.argsort(indices[valid], stable=True)]
        slots, counts = torch.unique_consecutive(indices[order], return_counts=True)
        cap = max(1, 2 * len(order) // max(1, len(slots)))  # above twice the mean, a group is big
        is_big = counts > cap
        # Small groups first in ``order`` (stable within each), big ones after.
        rank = torch.repeat_interleave(is_big, counts)
        order = order[torch.argsort(rank.to(torch.int8), stable=True)]
        small_counts = counts[~is_big]
        width = int(small_counts.max()) if len(small_counts) else 0
        starts = torch.cumsum(small_counts, 0) - small_counts
        group = torch.repeat_interleave(torch.arange(len(small_counts)), small_counts)
        flat = group * width + torch.arange(int(small_counts.sum())) - torch.repeat_interleave(starts, small_counts)
        big, at = [], int(small_counts.sum())
        for slot, n in zip(slots[is_big].tolist(), counts[is_big].tolist(), strict=True):
            big.append((slot, at, at + n))
            at += n
        return TokenGroups(order, slots[~is_big], width, flat, tuple(big))


def grouped_lora_linear(
    y: Tensor,
    x: Tensor,
    lora_a: tuple[Tensor, ...],
    lora_b: tuple[Tensor, ...],
    scale: float,
    groups: TokenGroups,
) -> None:
    """``y[t, slice i] += scale * (x[t] @ lora_a[i][s].T) @ lora_b[i][s].T`` for each token t of
    slot s; ``lora_a[i]``: [slots, 1, rank, in], ``lora_b[i]``: [slots, 1, out_i, rank]."""
    rank = lora_a[0].shape[-2]
    x = x.to(torch.float32)
    rows = x.new_empty((len(groups.order), sum(b.shape[-2] for b in lora_b)))
    n_small = len(groups.flat)
    if n_small:
        s, w, small = len(groups.small), groups.width, groups.small
        a = torch.cat([a[small, 0] for a in lora_a], dim=1).to(torch.float32)  # [s, k * rank, in]
        padded = x.new_zeros((s * w, x.shape[1]))
        padded[groups.flat] = x[groups.order[:n_small]]
        shrunk = torch.bmm(padded.view(s, w, -1), a.transpose(1, 2))  # [s, w, k * rank]
        out = torch.cat(
            [torch.bmm(shrunk[:, :, i * rank : (i + 1) * rank], b[small, 0].to(torch.float32).transpose(1, 2))
             for i, b in enumerate(lora_b)],
            dim=2,
        )  # fmt: skip
        rows[:n_small] = out.view(s * w, -1)[groups.flat]
    for slot, start, end in groups.big:
        a = torch.cat([a[slot, 0] for a in lora_a], dim=0).to(torch.float32)  # [k * rank, in]
        shrunk = x[groups.order[start:end]] @ a.T
        rows[start:end] = torch.cat(
            [shrunk[:, i * rank : (i + 1) * rank] @ b[slot, 0].to(torch.float32).T for i, b in enumerate(lora_b)], dim=1
        )
    if scale != 1.0:
        rows *= scale
    y[:, : rows.shape[1]].index_add_(0, groups.order, rows.to(y.dtype))


def _wrapper_class() -> type:
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    class Grouped(PunicaWrapperCPU):
        """vLLM's CPU punica wrapper with ``add_lora_linear`` grouped by adapter."""

        def update_metadata(self, *args: Any, **kwargs: Any) -> None:
            super().update_metadata(*args, **kwargs)
            self._groups: TokenGroups | None = None  # made on the step's first LoRA layer

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
            if getattr(self, "_groups", None) is None:
                self._groups = TokenGroups.of(indices)
            assert self._groups is not None
            grouped_lora_linear(flat_y, flat_x, lora_a_stacked, lora_b_stacked, scale, self._groups)

    Grouped.__name__ = Grouped.__qualname__ = "GroupedPunicaWrapperCPU"
    return Grouped


def __getattr__(name: str) -> Any:
    # Made on first use, so importing this module (the plugin) does not import vLLM.
    if name == "GroupedPunicaWrapperCPU":
        cls = _wrapper_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
