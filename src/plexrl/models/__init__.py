"""The models plexrl ships: a tiny random decoder for tests and demos, ``tiny-arith``, a tiny
decoder pretrained to partial competence on :mod:`plexrl.tasks`, and ``tiny-arith-chat``, the
same taught the Tinker cookbook's chat format (torch is imported lazily)."""

from pathlib import Path

from plexrl.models.tiny import QWEN3_CONFIGS, QWEN3_SHAPED_CONFIG, TINY_CONFIG, tiny_config, write_random_model
from plexrl.models.tokenizer import CharTokenizer

# The shipped pretrained model's directory (config, safetensors, tokenizer files, MODEL_CARD.md).
TINY_MODEL: str = str(Path(__file__).resolve().parent / "tiny-arith")
# tiny-arith taught the Tinker cookbook's chat format (the ``chat`` task): for Tinker programs.
TINY_CHAT_MODEL: str = str(Path(__file__).resolve().parent / "tiny-arith-chat")

__all__ = [
    "QWEN3_CONFIGS",
    "QWEN3_SHAPED_CONFIG",
    "TINY_CHAT_MODEL",
    "TINY_CONFIG",
    "TINY_MODEL",
    "CharTokenizer",
    "tiny_config",
    "write_random_model",
]
