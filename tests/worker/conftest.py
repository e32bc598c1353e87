"""Fixtures of the in-process engine tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Torch on one thread for the module: the tiny model gains nothing from intra-op threads, and
    OpenMP threads competing with other processes for this machine's 2 cores made single ops 100x
    slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
