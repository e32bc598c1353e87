"""Integration fixtures: ``cluster``, the client of the module's ``embedded`` cluster (a module
that uses it defines ``embedded``, a ``plexrl.local(...)`` with the options it needs)."""

from __future__ import annotations

import pytest_asyncio

import plexrl
from plexrl.client.connection import Client


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(embedded: plexrl.LocalCluster) -> Client:
    assert embedded.client is not None
    return embedded.client
