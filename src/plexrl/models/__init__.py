"""The models plexrl ships: a tiny random decoder for tests and demos (imports torch lazily)."""

from plexrl.models.tiny import TINY_CONFIG, tiny_config, write_random_model

__all__ = ["TINY_CONFIG", "tiny_config", "write_random_model"]
