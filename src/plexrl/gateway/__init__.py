"""A gateway that speaks the Tinker SDK's wire protocol onto a plexrl cluster: unmodified Tinker
programs (``TINKER_BASE_URL=http://HOST:PORT``) train and sample on the lab's own workers.

    plexrl tinker --coordinator tcp://head:7400 --key KEY --coordinator-key COORD.key --bind 0.0.0.0:8000
    plexrl tinker --local --workers 1 --policy plex     # on an embedded cluster, for one machine

``app.py``: the HTTP endpoints; ``service.py``: sessions, training models (plexrl jobs) and
sampling sessions, and the order requests run in; ``futures.py``: request ids and long-polled
outcomes; ``wire.py``: Tinker's datums and protobuf bodies to plexrl's types and back. Needs the
``tinker`` extra (the SDK's protobuf definitions): ``pip install "plexrl[tinker]"``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from plexrl.client.connection import Client
from plexrl.protocol import auth

log = logging.getLogger("plexrl.gateway")


async def serve(client: Client, host: str, port: int, ready: asyncio.Event | None = None) -> None:
    """Serve HTTP on ``host:port`` for ``client``'s cluster until SIGINT or SIGTERM."""
    from aiohttp import web

    from plexrl.gateway.app import make_app
    from plexrl.gateway.service import Gateway

    gateway = Gateway(client)
    # One access-log line per SDK request (the SDK long-polls) only when debugging.
    access = logging.getLogger("aiohttp.access")
    runner = web.AppRunner(make_app(gateway), access_log=access if access.isEnabledFor(logging.DEBUG) else None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        log.info("Tinker gateway on http://%s:%d (TINKER_BASE_URL) for coordinator %s", host, port, client.address)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready.set()
        await stop.wait()
    finally:
        await runner.cleanup()
        await gateway.close()


async def serve_coordinator(
    coordinator: str, host: str, port: int, credentials: auth.Credentials | None = None
) -> None:
    """``serve`` through one plexrl client of ``coordinator``."""
    async with Client(coordinator, credentials=credentials) as client:
        await serve(client, host, port)


async def serve_local(host: str, port: int, **cluster: Any) -> None:
    """``serve`` on an embedded cluster (``plexrl.local(**cluster)``), torn down with the gateway."""
    from plexrl.client.local import LocalCluster

    async with LocalCluster(**cluster) as client:
        await serve(client, host, port)
