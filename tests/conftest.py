"""Shared fixtures: the tiny model every test runs on, written once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# CI tries the same examples every run, so a red run is a change's fault, not the draw's. Searching
# for new failing sequences is a separate, deliberate run: HYPOTHESIS_PROFILE=search nox -s tests.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("search", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Workers default to vLLM where it is installed; the suite runs on the light transformers sampler
# except where a test asks for vLLM (tests/vllm), so its results do not depend on what is installed.
os.environ.setdefault("PLEXRL_SAMPLER", "hf")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from plexrl.models import write_random_model

    return write_random_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def qwen3_shaped_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-1.7B's vocabulary, head size, tied embeddings and special tokens on 2 small layers
    (random bf16 weights), with a BPE tokenizer and chat template trained and written beside it
    (``plexrl.models.bpe``): what the bf16 path and real tokenizers are tested on."""
    from plexrl.models import QWEN3_SHAPED_CONFIG, write_random_model
    from plexrl.models.bpe import write_qwen3_tokenizer

    path = write_random_model(
        tmp_path_factory.mktemp("models") / "qwen3-shaped", seed=0, shape=QWEN3_SHAPED_CONFIG, dtype="bfloat16"
    )
    return write_qwen3_tokenizer(path)
