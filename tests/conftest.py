"""Shared fixtures: the tiny model every test runs on, written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from plexrl.models import write_random_model

    return write_random_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)
