"""The models plexrl ships: a tiny random decoder for tests and demos, and ``tiny-arith``, a tiny
decoder pretrained to partial competence on :mod:`plexrl.tasks` (torch is imported lazily)."""

from pathlib import Path

from plexrl.models.tiny import TINY_CONFIG, tiny_config, write_random_model
from plexrl.models.tokenizer import CharTokenizer

# The shipped pretrained model's directory (config, safetensors, tokenizer files, MODEL_CARD.md).
TINY_MODEL: str = str(Path(__file__).resolve().parent / "tiny-arith")

__all__ = ["TINY_CONFIG", "TINY_MODEL", "CharTokenizer", "tiny_config", "write_random_model"]
