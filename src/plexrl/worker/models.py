"""Base models on a worker: each loaded once per path (frozen, in the worker's compute dtype) and
shared by its jobs.

LoRA jobs wrap the shared base in place with one peft ``PeftModel`` (``BaseModel.adapters``);
full fine-tune jobs take private copies built from its tensors (``BaseModel.copy``: float32 for
a trainer's master weights, the compute dtype for a sampler's copy).
Either way ``BaseModel.reference()`` is the untouched base, the reference for the KL term.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from plexrl.errors import BatchShapeError, ModelNotFoundError, TokenizerError
from plexrl.types import Ragged


@dataclass(eq=False)
class BaseModel:
    path: str
    model: Any  # transformers PreTrainedModel, frozen; LoRA layers are injected into it in place
    weights: dict[str, Tensor]  # the original tensors (taken before any wrapping), for copies
    stop_token_ids: tuple[int, ...]  # EOS ids of the config and of its generation config
    pad_token_id: int
    num_params: int
    linear_names: frozenset[str]  # what a LoRA may target: q_proj, v_proj, ... (not lm_head)
    dtype: torch.dtype  # the compute dtype its frozen weights are stored in
    adapters: Any = field(default=None)  # the shared peft PeftModel while a LoRA job is open

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The directory's transformers tokenizer (what the hf sampler matches stop strings with)."""
        require_tokenizer(self.path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def max_positions(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def device(self) -> torch.device:
        return next(iter(self.weights.values())).device

    def copy(self, dtype: torch.dtype = torch.float32) -> Any:
        """A private model with the base's weights in ``dtype`` (trainable, same device)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(self.model.config, dtype=dtype)
        model.load_state_dict(self.weights, strict=True)
        model.generation_config = self.model.generation_config
        return model.to(self.device)

    @contextmanager
    def reference(self) -> Iterator[nn.Module]:
        """The unmodified base model in eval mode (LoRA adapters, if any, disabled)."""
        if self.adapters is None:
            yield self.model.eval()
        else:
            with self.adapters.disable_adapter():
                yield self.adapters.eval()

    def check_tokens(
        self, tokens: Ragged, what: str, min_len: int, extra_positions: int = 0, engine_max_len: int | None = None
    ) -> None:
        """Raise ``BatchShapeError`` unless every row is a valid sequence of this model's token ids
        (and, with ``engine_max_len``, no longer than the vLLM engine that samples it takes)."""
        tokens.check(what)
        if not np.issubdtype(tokens.values.dtype, np.integer):
            raise BatchShapeError(f"{what}: token ids must be integers, got dtype {tokens.values.dtype}")
        if len(tokens) == 0:
            raise BatchShapeError(f"{what}: no rows; pass at least one sequence")
        lens = tokens.lengths()
        if lens.min() < min_len:
            raise BatchShapeError(f"{what}: every row needs at least {min_len} token(s)")
        if lens.max() + extra_positions > self.max_positions:
            raise BatchShapeError(
                f"{what}: a row of {lens.max()} tokens{' plus max_tokens' if extra_positions else ''} "
                f"exceeds the model's max_position_embeddings={self.max_positions}; shorten it"
            )
        if engine_max_len is not None and lens.max() + extra_positions > engine_max_len:
            raise BatchShapeError(
                f"{what}: a row of {lens.max()} tokens{' plus max_tokens' if extra_positions else ''} "
                f"exceeds the sampler's max_model_len={engine_max_len}; shorten it, lower max_tokens, "
                "or start the worker with a larger --max-model-len"
            )
        values = tokens.values
        if len(values) and (values.min() < 0 or values.max() >= self.vocab_size):
            raise BatchShapeError(
                f"{what}: token ids must be in [0, {self.vocab_size}) for {self.path}, "
                f"got range [{values.min()}, {values.max()}]"
            )


def has_tokenizer(path: str) -> bool:
    """Whether a model directory holds a transformers tokenizer (fast or sentencepiece)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model"))


def require_tokenizer(path: str) -> None:
    """Raise ``TokenizerError`` unless ``path`` has a tokenizer: stop strings are matched with it."""
    if not has_tokenizer(path):
        raise TokenizerError(f"stop strings need tokenizer files (tokenizer.json) in {path}; save the "
                             "tokenizer beside the model, or stop on stop_token_ids")  # fmt: skip


class ModelCache:
    """Base models by path, loaded on first use (in ``dtype``) and kept for the worker's life."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.device = device
        self.dtype = dtype
        self._models: dict[str, BaseModel] = {}
        self._lock = threading.Lock()  # opens load bases on a thread of their own; a restore, on the main one

    def get(self, path: str) -> BaseModel:
        key = os.path.abspath(path)
        with self._lock:
            if key not in self._models:
                self._models[key] = _load(path, self.device, self.dtype)
            return self._models[key]


def _load(path: str, device: torch.device, dtype: torch.dtype) -> BaseModel:
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a worker's log is for plexrl's own lines

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelNotFoundError(
            f"no model at {path!r}: expected a transformers model directory (config.json and weights) "
            "on the worker's host; save one with save_pretrained or plexrl.models.write_random_model"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise ModelNotFoundError(f"cannot load a causal LM from {path!r}: {e}; check the directory") from e
    model.requires_grad_(False)
    model.eval().to(device)
    stop = {*_ids(model.config.eos_token_id), *_ids(model.generation_config.eos_token_id)}
    pad = model.config.pad_token_id
    if pad is None:
        pad = min(stop) if stop else 0
    # A neutral generation config: the job's SamplingParams are the whole truth, never a
    # checkpoint's defaults such as a repetition penalty.
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=sorted(stop) or None, pad_token_id=pad
    )
    return BaseModel(
        path=path,
        model=model,
        weights=dict(model.state_dict()),
        stop_token_ids=tuple(sorted(stop)),
        pad_token_id=int(pad),
        num_params=sum(p.numel() for p in model.parameters()),
        linear_names=frozenset(
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name != "lm_head"
        ),
        dtype=dtype,
    )


def _ids(x: int | list[int] | None) -> list[int]:
    if x is None:
        return []
    return [int(x)] if isinstance(x, int) else [int(i) for i in x]


# Torch's default RNG, process-wide: a seeded block reseeds it, so no two threads of a worker may
# be inside one at once (vLLM's engines draw from their own processes' RNGs).
TORCH_GLOBALS = threading.RLock()


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch's RNG for the block and restore the global RNG state afterwards; no other
    thread of the process draws from it meanwhile (``TORCH_GLOBALS``), so what the block draws
    depends on ``seed`` only."""
    devices = [device] if device.type == "cuda" else []
    with TORCH_GLOBALS, torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed % (1 << 63))
        yield
