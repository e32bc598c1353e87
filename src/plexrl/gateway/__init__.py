"""A gateway that speaks the Tinker SDK's wire protocol onto a plexrl cluster: unmodified Tinker
programs (``TINKER_BASE_URL=http://HOST:PORT``) train and sample on the lab's own workers.

    plexrl tinker --coordinator tcp://head:7400 --key KEY --coordinator-key COORD.key --bind 0.0.0.0:8000

``app.py``: the HTTP endpoints; ``service.py``: sessions, training models (plexrl jobs) and
sampling sessions, and the order requests run in; ``futures.py``: request ids and long-polled
outcomes; ``wire.py``: Tinker's datums and protobuf bodies to plexrl's types and back. Needs the
``tinker`` extra (the SDK's protobuf definitions): ``pip install "plexrl[tinker]"``.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from plexrl.protocol import auth

log = logging.getLogger("plexrl.gateway")


async def serve(
    coordinator: str,
    host: str,
    port: int,
    credentials: auth.Credentials | None = None,
    ready: asyncio.Event | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM: one plexrl client to ``coordinator``, HTTP on ``host:port``."""
    from aiohttp import web

    from plexrl.client.connection import Client
    from plexrl.gateway.app import make_app
    from plexrl.gateway.service import Gateway

    async with Client(coordinator, credentials=credentials) as client:
        runner = web.AppRunner(make_app(Gateway(client)))
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        log.info("Tinker gateway on http://%s:%d for coordinator %s", host, port, coordinator)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready.set()
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
