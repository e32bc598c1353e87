"""The transformers sampler ("hf"): ``model.generate`` on left-padded prompts, with logprobs.

For small setups and fast tests. Each reported logprob is ``log_softmax(raw_logits / T)`` at the
sampled token (T = 1 when greedy) of the raw logits rather than the processed scores, so top-k,
top-p and the EOS mask of ``min_tokens`` never change it. ``generate`` keeps no step's logits:
the completions' logprobs are computed afterwards in one forward over prompt and completion, the
way the trainer computes them (chunked, ``forward.target_logprobs``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from plexrl.protocol.calls import Generated
from plexrl.text import stop_index
from plexrl.types import Ragged, SamplingParams
from plexrl.worker.models import seeded
from plexrl.worker.trainer.forward import target_logprobs


def generate(
    model: Any,  # a transformers or peft causal LM
    prompts: Ragged,
    params: SamplingParams,
    *,
    seed: int,
    stop_token_ids: tuple[int, ...],
    pad_token_id: int,
    weight_version: int,
    tokenizer: Any = None,
    chunk_elements: int | None = 1 << 25,
    tick: Callable[[], None] = lambda: None,
) -> Generated:
    """``params.n`` completions per prompt, in prompt-major order; prompts must be validated.
    ``tokenizer``: the model's, for ``params.stop`` (transformers stops a row at a stop string;
    it is cut after the token completing it). ``tick`` is called once per decoding step (the
    worker's progress)."""
    from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

    class Ticking(StoppingCriteria):
        def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs: Any) -> Tensor:
            tick()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    device = next(model.parameters()).device
    input_ids_B_T, attention_B_T = _pad_left(prompts, pad_token_id, device)
    greedy = params.temperature == 0.0
    # transformers refuses num_return_sequences > 1 without sampling; greedy rows are identical anyway.
    copies = params.n if greedy else 1
    sampling = {} if greedy else {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p}
    config = GenerationConfig(
        max_new_tokens=params.max_tokens,
        min_new_tokens=params.min_tokens or None,  # masks the eos_token_id list below until then
        do_sample=not greedy,
        num_return_sequences=1 if greedy else params.n,
        eos_token_id=sorted({*stop_token_ids, *params.stop_token_ids}) or None,
        pad_token_id=pad_token_id,
        return_dict_in_generate=True,
        stop_strings=list(params.stop) or None,
        **sampling,
    )
    model.eval()
    with seeded(seed, device), torch.no_grad():
        out = model.generate(
            input_ids=input_ids_B_T,
            attention_mask=attention_B_T,
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([Ticking()]),
            **({"tokenizer": tokenizer} if params.stop else {}),
        )
    new_B_N = out.sequences[:, input_ids_B_T.shape[1] :].cpu()
    rows, finished = _trim(new_B_N, {*stop_token_ids, *params.stop_token_ids})
    for i, row in enumerate(rows):  # a row that met a stop string ran on in padding: cut it there
        k = stop_index(tokenizer.decode, row.tolist(), params.stop) if params.stop else None
        if k is not None:
            rows[i], finished[i] = row[:k], True
    logps = _logprobs(model, prompts, rows, params.n // copies, 1.0 if greedy else params.temperature, chunk_elements)
    if copies > 1:
        rows = [r for r in rows for _ in range(copies)]
        logps = [lp for lp in logps for _ in range(copies)]
        finished = [f for f in finished for _ in range(copies)]
    return Generated(
        tokens=Ragged.from_rows(rows, "int32"),
        logprobs=Ragged.from_rows(logps, "float32"),
        prompt_index_B=np.repeat(np.arange(len(prompts), dtype=np.int32), params.n),
        finish_reasons=["stop" if f else "length" for f in finished],
        weight_version=weight_version,
    )


def _logprobs(
    model: Any, prompts: Ragged, rows: list[np.ndarray], n: int, temperature: float, chunk_elements: int | None
) -> list[np.ndarray]:
    """Each completion's logprobs (``n`` per prompt, prompt-major), from one no-grad forward over
    every prompt + completion padded on the right."""
    full = [np.concatenate([prompts[i // n], row]).astype(np.int64) for i, row in enumerate(rows)]
    lens_B = np.array([len(f) for f in full])
    device = next(model.parameters()).device
    tokens_B_T = torch.zeros((len(full), int(lens_B.max())), dtype=torch.long)
    select_B_T1 = torch.zeros((len(full), tokens_B_T.shape[1] - 1), dtype=torch.bool)
    for i, (f, row) in enumerate(zip(full, rows, strict=True)):
        tokens_B_T[i, : len(f)] = torch.from_numpy(f)
        select_B_T1[i, len(f) - 1 - len(row) : len(f) - 1] = True
    with torch.no_grad():
        logp_B_T1 = target_logprobs(model, tokens_B_T.to(device), select_B_T1.to(device), temperature, chunk_elements)
    logp_B_T1 = logp_B_T1.cpu()
    return [logp_B_T1[i][select_B_T1[i]].numpy() for i in range(len(full))]


def _pad_left(prompts: Ragged, pad_token_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    lens_B = prompts.lengths()
    T = int(lens_B.max())
    input_ids_B_T = torch.full((len(prompts), T), pad_token_id, dtype=torch.long)
    attention_B_T = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, row in enumerate(prompts):
        input_ids_B_T[i, T - len(row) :] = torch.from_numpy(row.astype(np.int64))
        attention_B_T[i, T - len(row) :] = 1
    return input_ids_B_T.to(device), attention_B_T.to(device)


def _trim(new_B_N: Tensor, stop: set[int]) -> tuple[list[np.ndarray], list[bool]]:
    """Each row cut after its first stop token (kept), and whether it had one (else it ran to
    ``max_tokens``)."""
    is_stop_B_N = torch.isin(new_B_N, torch.tensor(sorted(stop), dtype=new_B_N.dtype))
    has_stop_B = is_stop_B_N.any(dim=1)
    first_stop_B = is_stop_B_N.int().argmax(dim=1)
    lens_B = torch.where(has_stop_B, first_stop_B + 1, torch.full_like(first_stop_B, new_B_N.shape[1]))
    return [new_B_N[i, : int(k)].numpy() for i, k in enumerate(lens_B)], has_stop_B.tolist()
