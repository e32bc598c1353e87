"""The transformers sampler ("hf"): ``model.generate`` on left-padded prompts, with logprobs.

For small setups and fast tests. Each reported logprob is ``log_softmax(raw_logits / T)`` at the
sampled token (T = 1 when greedy), taken from the raw logits rather than the processed scores, so
top-k, top-p and the EOS mask of ``min_tokens`` never change it and it is directly comparable with
the trainer's logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from plexrl.protocol.calls import Generated
from plexrl.types import Ragged, SamplingParams
from plexrl.worker.models import seeded
from plexrl.worker.trainer.losses import token_logprobs


def generate(
    model: Any,  # a transformers or peft causal LM
    prompts: Ragged,
    params: SamplingParams,
    *,
    seed: int,
    stop_token_ids: tuple[int, ...],
    pad_token_id: int,
    weight_version: int,
    tick: Callable[[], None] = lambda: None,
) -> Generated:
    """``params.n`` completions per prompt, in prompt-major order; prompts must be validated.
    ``tick`` is called once per decoding step (the worker's progress)."""
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
        output_logits=True,
        **sampling,
    )
    model.eval()
    with seeded(seed, device), torch.no_grad():
        out = model.generate(
            input_ids=input_ids_B_T,
            attention_mask=attention_B_T,
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([Ticking()]),
        )
        new_B_N = out.sequences[:, input_ids_B_T.shape[1] :]
        logp_B_N = token_logprobs(torch.stack(out.logits, dim=1), new_B_N, 1.0 if greedy else params.temperature)
    if copies > 1:
        new_B_N = new_B_N.repeat_interleave(copies, dim=0)
        logp_B_N = logp_B_N.repeat_interleave(copies, dim=0)
    return _trim(new_B_N, logp_B_N, {*stop_token_ids, *params.stop_token_ids}, params.n, weight_version)


def _pad_left(prompts: Ragged, pad_token_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    lens_B = prompts.lengths()
    T = int(lens_B.max())
    input_ids_B_T = torch.full((len(prompts), T), pad_token_id, dtype=torch.long)
    attention_B_T = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, row in enumerate(prompts):
        input_ids_B_T[i, T - len(row) :] = torch.from_numpy(row.astype(np.int64))
        attention_B_T[i, T - len(row) :] = 1
    return input_ids_B_T.to(device), attention_B_T.to(device)


def _trim(new_B_N: Tensor, logp_B_N: Tensor, stop: set[int], n: int, weight_version: int) -> Generated:
    """Cut each row after its first stop token (kept); rows without one ran to ``max_tokens``."""
    new_B_N = new_B_N.cpu()
    logp_B_N = logp_B_N.cpu()
    is_stop_B_N = torch.isin(new_B_N, torch.tensor(sorted(stop), dtype=new_B_N.dtype))
    has_stop_B = is_stop_B_N.any(dim=1)
    first_stop_B = is_stop_B_N.int().argmax(dim=1)
    lens_B = torch.where(has_stop_B, first_stop_B + 1, torch.full_like(first_stop_B, new_B_N.shape[1]))
    rows = [new_B_N[i, : int(k)].numpy() for i, k in enumerate(lens_B)]
    logps = [logp_B_N[i, : int(k)].numpy() for i, k in enumerate(lens_B)]
    return Generated(
        tokens=Ragged.from_rows(rows, "int32"),
        logprobs=Ragged.from_rows(logps, "float32"),
        prompt_index_B=np.repeat(np.arange(len(rows) // n, dtype=np.int32), n),
        finish_reasons=["stop" if s else "length" for s in has_stop_B.tolist()],
        weight_version=weight_version,
    )
