"""The tiny random decoder plexrl tests, demos and benchmarks run on (no model hub needed).

Qwen2 architecture so both samplers load it: vLLM's CPU attention needs a head size of 32 or
more, hence 128 hidden / 4 heads. 1024 positions (RoPE: positions cost no parameters) leave room
for the worked solutions of ``sum`` and for multi-turn trajectories. Weights are random but
deterministic given the seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "intermediate_size": 256,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": True,
}


def tiny_config(**overrides: Any) -> Any:
    """A fresh ``transformers.Qwen2Config`` built from :data:`TINY_CONFIG` and ``overrides``."""
    from transformers import Qwen2Config

    return Qwen2Config(**{**TINY_CONFIG, **overrides})


def write_random_model(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a randomly initialised tiny model (float32 safetensors) to ``path`` and return it;
    ``overrides`` change :data:`TINY_CONFIG` (a bigger model for a bench: ``hidden_size=512``)."""
    import torch
    from transformers import Qwen2ForCausalLM

    path = Path(path)
    # fork_rng: writing a model must not move the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = Qwen2ForCausalLM(tiny_config(**overrides))
    model.to(torch.float32)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(path, safe_serialization=True)
    return path
