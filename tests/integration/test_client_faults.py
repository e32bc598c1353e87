"""The client against a coordinator that misbehaves: a stand-in ROUTER socket in this process
answers the handshake, then sends replies the client cannot decode."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

import plexrl
from plexrl.errors import MalformedMessageError
from plexrl.protocol import messages as m
from plexrl.protocol.codec import Codec

CODEC: Codec[m.ToCoordinator] = Codec(m.ToCoordinator)


async def test_an_undecodable_reply_fails_its_call_instead_of_hanging() -> None:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def coordinator() -> None:
        while True:
            ident, *frames = await router.recv_multipart(copy=False)
            msg = CODEC.decode(frames)
            if isinstance(msg, m.Hello):
                welcome = m.Welcome(rid=msg.rid, client_id="c", heartbeat_interval_s=60.0, heartbeat_liveness=5)
                await router.send_multipart([ident.bytes, *CODEC.encode(welcome)])
            elif isinstance(msg, m.StatusRequest):  # the right request id, a body of no known type
                body = msgspec.msgpack.encode({"type": "no_such_reply", "v": 1, "rid": msg.rid})
                await router.send_multipart([ident.bytes, body])

    serving = asyncio.create_task(coordinator())
    try:
        async with asyncio.timeout(30), plexrl.connect(f"tcp://127.0.0.1:{port}", credentials=None) as client:
            with pytest.raises(MalformedMessageError):
                await client.status()
    finally:
        serving.cancel()
        router.close()
        ctx.term()
