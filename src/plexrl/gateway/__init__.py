"""A gateway that speaks the Tinker SDK's wire protocol onto a plexrl cluster: unmodified Tinker
programs (``TINKER_BASE_URL=http://HOST:PORT``) train and sample on the lab's own workers.

    plexrl tinker --coordinator tcp://head:7400 --key KEY --coordinator-key COORD.key --bind 0.0.0.0:8000
    plexrl tinker --coordinator tcp://head:7400 --coordinator-key COORD.key --tenants tenants.json --bind ...
    plexrl tinker --local --workers 1 --policy plex     # on an embedded cluster, for one machine

``app.py``: the HTTP endpoints; ``tenants.py``: the plexrl client (tenant) of each API key; ``service.py``: sessions, training models (plexrl jobs) and
sampling sessions, and the order requests run in; ``futures.py``: request ids and long-polled
outcomes; ``wire.py``: Tinker's datums and protobuf bodies to plexrl's types and back. Needs the
``tinker`` extra (the SDK's protobuf definitions): ``pip install "plexrl[tinker]"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from plexrl.client.connection import Client
from plexrl.gateway.tenants import KeyedTenants, SharedTenant, Tenants
from plexrl.protocol import auth

if TYPE_CHECKING:
    from plexrl.gateway.service import Gateway

log = logging.getLogger("plexrl.gateway")


@contextlib.asynccontextmanager
async def running(
    gateway: Gateway, host: str = "127.0.0.1", port: int = 0, fwdbwd_max_chunk_len: int | None = None
) -> AsyncIterator[str]:
    """``gateway`` served on ``host:port`` (0: a free port) while the block runs; yields its URL.
    Leaving closes the gateway: its sessions' jobs, then its tenants' clients."""
    from aiohttp import web

    from plexrl.gateway.app import make_app

    # One access-log line per SDK request (the SDK long-polls) only when debugging.
    access = logging.getLogger("aiohttp.access")
    app = make_app(gateway, fwdbwd_max_chunk_len)
    runner = web.AppRunner(app, access_log=access if access.isEnabledFor(logging.DEBUG) else None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        yield f"http://{host}:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def serve(tenants: Tenants, host: str, port: int, coordinator: str) -> None:
    """Serve HTTP on ``host:port``, each API key's jobs on its ``tenants`` client, until SIGINT or SIGTERM."""
    from plexrl.gateway.service import Gateway

    async with running(Gateway(tenants), host, port) as url:
        log.info("Tinker gateway on %s (TINKER_BASE_URL) for coordinator %s", url, coordinator)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()


async def serve_coordinator(coordinator: str, host: str, port: int, credentials: auth.Credentials | None) -> None:
    """``serve`` for ``coordinator``, every API key's jobs on the gateway's own key (``credentials``)."""
    async with Client(coordinator, credentials=credentials) as client:
        await serve(SharedTenant(client), host, port, coordinator)


async def serve_tenants(coordinator: str, host: str, port: int, tenants_file: str, coordinator_public: bytes) -> None:
    """``serve`` for ``coordinator``, each API key's jobs on the client key ``tenants_file`` maps it to."""
    await serve(KeyedTenants.from_file(coordinator, tenants_file, coordinator_public), host, port, coordinator)


async def serve_local(host: str, port: int, **cluster: Any) -> None:
    """``serve`` on an embedded cluster (``plexrl.local(**cluster)``), torn down with the gateway;
    each API key gets a client key of its own (a plexrl tenant) on first use."""
    from plexrl.client.local import LocalCluster

    local = LocalCluster(**cluster)
    async with local as client:
        assert local.keys is not None  # made by the cluster's start
        await serve(KeyedTenants.issued(client.address, local.keys), host, port, client.address)
