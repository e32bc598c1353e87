"""The trainer's forward pass under a memory budget: precision, checkpointing, chunked logprobs.

Memory per trained token is bounded by settings, never by the size of a call:

- **precision**: the frozen base weights are stored in the compute dtype (bf16 on GPUs); the
  trained weights (LoRA adapters, a full copy) and AdamW's moments stay in float32 masters, and
  the forward runs under autocast to the compute dtype (verl's FSDP ``MixedPrecision``,
  OpenRLHF's ``--bf16``). Logprobs and losses are reduced in float32.
- **gradient checkpointing**: each decoder layer keeps only its input for the backward, which
  recomputes the rest (transformers' own, non-reentrant).
- **chunked logprobs**: logits exist only at the positions whose logprobs are wanted, a chunk of
  positions at a time (``chunk_elements`` logits each), and are never kept for the backward, which
  recomputes a chunk's (``HeadLogprobs``): no ``[B, T, V]`` tensor (151,936 columns for Qwen3)
  is ever alive.
- **micro-batches** (``microbatches``): a call's rows are cut into pieces of at most
  ``max_tokens`` padded tokens, each forwarded and backpropagated before the next.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from plexrl.worker.trainer.losses import token_logprobs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def worker_dtype(dtype: str, device: str) -> str:
    """``--dtype``: "auto" is bfloat16 on a GPU and float32 on CPU (the shipped tiny models are
    float32; CPU bf16 runs, as CI checks, but buys a tiny model nothing)."""
    if dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose auto, {', '.join(DTYPES)}")
    return dtype


@dataclass(frozen=True)
class TrainerSettings:
    """A worker's trainer settings (``plexrl worker --dtype ... --max-tokens-per-microbatch ...``)."""

    dtype: str = "float32"  # the compute dtype: base weights stored in it, forwards autocast to it
    # Padded tokens one forward/backward holds at most (a row longer than this goes alone); None: a
    # call's rows in one piece (only for measuring the unbounded path, bench/memory.py).
    max_tokens_per_microbatch: int | None = 8192
    # Logits computed at once, in elements (positions x vocabulary); None: every position's logits
    # in one tensor (the unbounded path, for bench/memory.py).
    chunk_elements: int | None = 1 << 25
    # Jobs whose base model has at least this many parameters checkpoint their decoder layers
    # unless they say otherwise (``plexrl.job(..., gradient_checkpointing=...)``).
    checkpointing_min_params: int = 100_000_000

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            raise ValueError(f"max_tokens_per_microbatch={self.max_tokens_per_microbatch} must be >= 1")
        if self.chunk_elements is not None and self.chunk_elements < 1:
            raise ValueError(f"chunk_elements={self.chunk_elements} must be >= 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    """Compute in ``dtype`` inside (float32: nothing to do)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def set_checkpointing(model: nn.Module, on: bool) -> None:
    """Turn the decoder layers' gradient checkpointing on or off (a no-op if already so); the base
    model is shared by a worker's LoRA jobs, so this is set before each job's forward."""
    causal = _causal_lm(model)
    if bool(getattr(causal, "is_gradient_checkpointing", False)) == on:
        return
    if on:
        causal.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        causal.gradient_checkpointing_disable()


def target_logprobs(
    model: nn.Module,
    tokens_B_T: Tensor,
    select_B_T1: Tensor,
    temperature: float,
    chunk_elements: int | None,
) -> Tensor:
    """Float32 logprobs of the targets ``tokens_B_T[:, 1:]`` where ``select_B_T1`` is true, laid
    out as ``select_B_T1`` (zeros elsewhere), ``chunk_elements`` logits at a time (None: every
    position's at once). Rows are padded on the right, so under the causal mask no real token
    sees padding: no attention mask or position ids are needed."""
    if isinstance(model, ShardedRoot):  # its forward is this function: FSDP2 gathers the root's shards around it
        return model(tokens_B_T, select_B_T1, temperature, chunk_elements)
    causal = _causal_lm(model)
    if chunk_elements is None:  # the unbounded path: every position's logits at once
        logits_B_T1_V = causal(input_ids=tokens_B_T, use_cache=False).logits[:, :-1]
        logp_B_T1 = token_logprobs(logits_B_T1_V, tokens_B_T[:, 1:], temperature)
        return torch.where(select_B_T1, logp_B_T1, torch.zeros_like(logp_B_T1))
    hidden_B_T_H = causal.get_decoder()(input_ids=tokens_B_T, use_cache=False).last_hidden_state
    hidden_N_H = hidden_B_T_H[:, :-1][select_B_T1]
    targets_N = tokens_B_T[:, 1:][select_B_T1]
    head = causal.get_output_embeddings()
    weight_V_H = head.weight
    chunk = max(1, chunk_elements // int(weight_V_H.shape[0]))
    device_type = tokens_B_T.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight_V_H.dtype
    pieces = [
        HeadLogprobs.apply(hidden_N_H[i : i + chunk], weight_V_H, targets_N[i : i + chunk], temperature, dtype)
        for i in range(0, int(targets_N.shape[0]), chunk)
    ]
    logp_B_T1 = torch.zeros(select_B_T1.shape, dtype=torch.float32, device=tokens_B_T.device)
    if pieces:
        logp_B_T1 = logp_B_T1.masked_scatter(select_B_T1, torch.cat(pieces))
    return logp_B_T1


class ShardedRoot(nn.Module):
    """The root of a model sharded with FSDP2 (``trainer/sharded.py``): a module whose forward is
    ``target_logprobs`` of the causal LM inside. FSDP2 gathers a module's own shards (here the
    embeddings, the final norm and the output layer) only around a call of that module, and
    ``target_logprobs`` reads the output layer's weight itself, outside any forward."""

    def __init__(self, causal: nn.Module) -> None:
        super().__init__()
        self.causal = causal

    def get_base_model(self) -> nn.Module:
        return self.causal

    def forward(
        self, tokens_B_T: Tensor, select_B_T1: Tensor, temperature: float, chunk_elements: int | None
    ) -> Tensor:
        return target_logprobs(self.causal, tokens_B_T, select_B_T1, temperature, chunk_elements)


class HeadLogprobs(torch.autograd.Function):
    """Logprobs of ``targets_N`` under ``softmax(hidden_N_H @ weight_V_H.T / T)`` for one chunk of
    positions, keeping no logits: the forward keeps each position's log-sum-exp, the backward
    recomputes the chunk's logits and turns them into their gradient in place (one float32
    ``[N, V]`` buffer and its copy in the compute dtype at a time, instead of the half-dozen
    tensors autograd would keep). The matmuls run in ``dtype`` (the autocast dtype), the
    softmax in float32."""

    @staticmethod
    def forward(
        ctx: Any, hidden_N_H: Tensor, weight_V_H: Tensor, targets_N: Tensor, temperature: float, dtype: torch.dtype
    ) -> Tensor:
        logits_N_V = _logits(hidden_N_H, weight_V_H, dtype, temperature)
        lse_N = torch.logsumexp(logits_N_V, dim=-1)
        logp_N = logits_N_V.gather(-1, targets_N.long().unsqueeze(-1)).squeeze(-1) - lse_N
        ctx.save_for_backward(hidden_N_H, weight_V_H, targets_N, lse_N)
        ctx.temperature, ctx.dtype = temperature, dtype
        return logp_N

    @staticmethod
    def backward(ctx: Any, grad_N: Tensor) -> tuple[Tensor | None, ...]:
        hidden_N_H, weight_V_H, targets_N, lse_N = ctx.saved_tensors
        # d logp / d logits = (onehot(target) - softmax) / T, scaled by the incoming gradient.
        grad_N_V = _logits(hidden_N_H, weight_V_H, ctx.dtype, ctx.temperature)
        grad_N_V.sub_(lse_N.unsqueeze(-1)).exp_().mul_(-grad_N.float().unsqueeze(-1))
        grad_N_V.scatter_add_(-1, targets_N.long().unsqueeze(-1), grad_N.float().unsqueeze(-1))
        grad_N_V = _for_matmul(grad_N_V.div_(ctx.temperature).to(ctx.dtype))
        weight = weight_V_H.to(ctx.dtype)
        grad_hidden = (grad_N_V @ weight).to(hidden_N_H.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:  # a full fine-tune's (tied) output layer
            grad_weight = (grad_N_V.t() @ hidden_N_H.to(ctx.dtype)).to(weight_V_H.dtype)
        return grad_hidden, grad_weight, None, None, None


def _logits(hidden_N_H: Tensor, weight_V_H: Tensor, dtype: torch.dtype, temperature: float) -> Tensor:
    """Float32 ``hidden @ weight.T / temperature``, the matmul in ``dtype``."""
    logits_N_V = (hidden_N_H.to(dtype) @ weight_V_H.to(dtype).t()).float()
    return logits_N_V.div_(temperature) if temperature != 1.0 else logits_N_V


def _for_matmul(grad_N_V: Tensor) -> Tensor:
    """The gradient laid out for its matmul with the output layer. CPU only: torch's bf16 GEMM on
    CPUs without bf16 instructions (AVX2) takes a slow path for a row-major ``[N, V]`` left operand
    (seen: 67 s against 1.0 s column-major, N=220, V=151,936); a GPU's GEMM takes either layout."""
    if grad_N_V.device.type != "cpu" or grad_N_V.dtype == torch.float32:
        return grad_N_V
    return grad_N_V.t().contiguous().t()


def microbatches(lengths: np.ndarray, max_tokens: int | None, waste: float = 0.25) -> list[np.ndarray]:
    """Row indices in micro-batches, longest rows first: rows of similar length together (padding
    a row to its micro-batch's longest costs at most ``waste`` of that length, so a long-tailed
    batch does not compute mostly padding), and at most ``max_tokens`` padded tokens each (a row
    longer than that goes alone)."""
    pieces: list[list[int]] = []
    top = 0
    for i in np.argsort(-lengths, kind="stable"):
        length = int(lengths[i])
        full = max_tokens is not None and pieces and (len(pieces[-1]) + 1) * top > max_tokens
        if not pieces or length < (1 - waste) * top or full:
            pieces.append([])
            top = length
        pieces[-1].append(int(i))
    return [np.array(p, dtype=np.int64) for p in pieces]


def _causal_lm(model: nn.Module) -> Any:
    """The transformers causal LM inside ``model`` (a peft ``PeftModel`` wraps one; its LoRA
    layers are injected into it in place)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model
