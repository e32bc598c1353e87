"""The HTTP side of the gateway (aiohttp): the Tinker SDK's endpoints under ``/api/v1``.

aiohttp because the gateway needs raw bodies (protobuf in and out), long-held polls and a
server in the same asyncio loop as its plexrl client, and nothing else: one well-kept package
(maintained since 2014) with its own server, no ASGI stack or validation models in between
(the SDK's own pydantic models define the wire; the gateway reads the fields it needs).

Mutating requests answer at once with ``{"request_id", ...}`` (an ``UntypedAPIFuture``); their
outcomes come from ``retrieve_future``. Errors in a request itself answer HTTP 400 (a bad body),
401 (no ``tml-`` key), 404 (an unknown id), always with a JSON body (the SDK retries an empty
400 as a proxy's reset).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from tinker.proto import tinker_public_pb2 as pb

from plexrl.errors import InvalidRequestError, PlexError
from plexrl.gateway.futures import Failed, Json, Proto
from plexrl.gateway.service import Gateway, NotFoundError

log = logging.getLogger("plexrl.gateway")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
GATEWAY = web.AppKey("gateway", Gateway)
OWNER = web.RequestKey("owner", str)  # the request's API key
SWEEP_S = 10.0  # how often finished outcomes and silent sessions are looked for


def _error(status: int, message: str, category: str = "user") -> web.Response:
    return web.json_response({"error": message, "category": category}, status=status)


@web.middleware
async def _api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every request names its key (``X-API-Key: tml-...``); a key sees only its own sessions."""
    key = request.headers.get("X-API-Key", "")
    if request.path != "/api/v1/healthz":
        if not key.startswith("tml-"):
            return _error(
                401, "send a Tinker API key (X-API-Key: tml-...); the gateway maps each key to its own sessions"
            )
        if not request.app[GATEWAY].tenants.admits(key):
            return _error(401, "this API key is not one of the gateway's tenants (plexrl tinker --tenants)")
    request[OWNER] = key
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except (NotFoundError, KeyError) as e:
        return _error(404, f"{e}")
    except InvalidRequestError as e:
        return _error(400, f"{e.code}: {e.message}")
    except PlexError as e:  # the cluster's trouble, not the request's: the SDK retries a 5xx
        return _error(503, f"{e.code}: {e.message}", "server")
    except (ValueError, TypeError, json.JSONDecodeError) as e:
        return _error(400, f"bad request body: {e}")


async def _body(request: web.Request) -> dict[str, Any]:
    body = await request.json()
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


def _future(request_id: str, **extra: Any) -> web.Response:
    return web.json_response({"request_id": request_id, **{k: v for k, v in extra.items() if v is not None}})


def routes(gateway: Gateway, fwdbwd_max_chunk_len: int | None = None) -> list[web.RouteDef]:
    """The endpoints; ``fwdbwd_max_chunk_len`` (client config) splits forward_backward into chunks
    of at most that many datums (tests use it to exercise chunk ordering)."""
    api = "/api/v1"

    async def client_config(request: web.Request) -> web.Response:
        config: dict[str, Any] = {"use_pyqwest_transport": False}
        if fwdbwd_max_chunk_len is not None:
            config["fwdbwd_max_chunk_len"] = fwdbwd_max_chunk_len
        return web.json_response(config)

    async def not_here(request: web.Request) -> web.Response:
        return _error(404, f"{request.path} is not served by plexrl's gateway")

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def capabilities(request: web.Request) -> web.Response:
        return web.json_response({"supported_models": []})  # any model directory the workers can read

    async def telemetry(request: web.Request) -> web.Response:
        return web.json_response({"status": "accepted"})  # accepted and dropped

    async def create_session(request: web.Request) -> web.Response:
        await _body(request)
        session_id = gateway.create_session(request[OWNER], uuid.uuid4().hex)
        return web.json_response({"type": "create_session", "session_id": session_id})

    async def heartbeat(request: web.Request) -> web.Response:
        body = await _body(request)
        try:
            gateway.heartbeat(request[OWNER], body["session_id"])
        except NotFoundError as e:
            return _error(410, f"{e}")  # the SDK stops heartbeating a session the server let go
        return web.json_response({"type": "session_heartbeat"})

    async def finish(request: web.Request) -> web.Response:
        await gateway.finish(request[OWNER], request.match_info["session_id"])
        return web.json_response({})

    async def create_model(request: web.Request) -> web.Response:
        body = await _body(request)
        owner = request[OWNER]
        gateway.session(owner, body["session_id"])
        key = (f"{body['session_id']}:model", int(body["model_seq_id"]))
        request_id = gateway.submit(owner, key, lambda: gateway.create_model(owner, body))
        return _future(request_id)

    async def get_info(request: web.Request) -> web.Response:
        body = await _body(request)
        return web.json_response(gateway.info(request[OWNER], body["model_id"]))

    def training(name: str) -> Handler:
        async def handle(request: web.Request) -> web.Response:
            body = await _body(request)
            owner = request[OWNER]
            model = gateway.model(owner, body["model_id"])
            work = getattr(gateway, name)
            seq = body.get("seq_id")
            key = None if seq is None else (model.model_id, int(seq))
            return _future(gateway.submit(owner, key, lambda: work(model, body)), model_id=model.model_id)

        return handle

    async def forward_backward(request: web.Request) -> web.Response:
        if request.content_type != "application/x-protobuf":
            return _error(400, "forward_backward takes a protobuf body (Content-Type: application/x-protobuf)")
        if request.headers.get("Content-Encoding", "") not in ("", "identity"):
            return _error(400, "compressed forward_backward bodies are not supported (proto_compress_fwdbwd is off)")
        proto = pb.ForwardBackwardRequest()
        proto.ParseFromString(await request.read())
        owner = request[OWNER]
        model = gateway.model(owner, proto.model_id)
        key = (model.model_id, int(proto.seq_id)) if proto.seq_id else None
        request_id = gateway.submit(owner, key, lambda: gateway.forward_backward(model, proto))
        return _future(request_id, model_id=model.model_id)

    async def create_sampler(request: web.Request) -> web.Response:
        body = await _body(request)
        sampler_id = await gateway.create_sampler(request[OWNER], body)
        return web.json_response({"type": "create_sampling_session", "sampling_session_id": sampler_id})

    async def get_sampler(request: web.Request) -> web.Response:
        sampler = gateway.sampler(request[OWNER], request.match_info["sampler_id"])
        return web.json_response({"sampler_id": sampler.sampler_id, "base_model": sampler.base_model,
                                  "model_path": sampler.model_path})  # fmt: skip

    async def sample(request: web.Request) -> web.Response:
        body = await _body(request)
        owner = request[OWNER]
        sampler_id, seq = body.get("sampling_session_id"), body.get("seq_id")
        if sampler_id:
            gateway.sampler(owner, sampler_id)
        key = (f"{sampler_id}", int(seq)) if sampler_id and seq is not None else None
        request_id = gateway.submit(owner, key, lambda: gateway.sample(owner, body))
        n = int(body.get("num_samples", 1))
        return _future(request_id, sample_sequence_ids=[f"{request_id}:{i}" for i in range(n)])

    async def retrieve(request: web.Request) -> web.Response:
        body = await _body(request)
        request_id = str(body["request_id"])
        try:
            outcome = await gateway.futures.retrieve(request[OWNER], request_id)
        except KeyError:
            return _error(410, f"no request {request_id!r} here (unknown, or its outcome was dropped)")
        match outcome:
            case None:
                return web.json_response({"type": "try_again", "request_id": request_id, "queue_state": "active"})
            case Proto(body=data):
                return web.Response(body=data, content_type="application/x-protobuf")
            case Json(body=result):
                return web.json_response(result)
            case Failed(error=error, category=category):
                return web.json_response({"error": error, "category": category})
        raise AssertionError(outcome)

    return [
        web.post(f"{api}/client/config", client_config),
        web.post(f"{api}/client/dynamic_config", not_here),
        web.get(f"{api}/healthz", healthz),
        web.get(f"{api}/get_server_capabilities", capabilities),
        web.post(f"{api}/telemetry", telemetry),
        web.post(f"{api}/create_session", create_session),
        web.post(f"{api}/session_heartbeat", heartbeat),
        web.post(f"{api}/sessions/{{session_id}}/finish", finish),
        web.post(f"{api}/create_model", create_model),
        web.post(f"{api}/get_info", get_info),
        web.post(f"{api}/forward_backward", forward_backward),
        web.post(f"{api}/optim_step", training("optim_step")),
        web.post(f"{api}/save_weights_for_sampler", training("save_for_sampler")),
        web.post(f"{api}/save_weights", training("save")),
        web.post(f"{api}/load_weights", training("load")),
        web.post(f"{api}/create_sampling_session", create_sampler),
        web.get(f"{api}/samplers/{{sampler_id}}", get_sampler),
        web.post(f"{api}/asample", sample),
        web.post(f"{api}/retrieve_future", retrieve),
    ]


def make_app(gateway: Gateway, fwdbwd_max_chunk_len: int | None = None) -> web.Application:
    app = web.Application(middlewares=[_api_key], client_max_size=256 << 20)
    app[GATEWAY] = gateway
    app.add_routes(routes(gateway, fwdbwd_max_chunk_len))

    async def sweeper(app: web.Application) -> AsyncIterator[None]:
        async def sweep() -> None:
            while True:
                await asyncio.sleep(SWEEP_S)
                gateway.futures.sweep()
                try:
                    await gateway.expire()
                except PlexError as e:
                    log.warning("finishing a silent session failed: %s", e)

        task = asyncio.ensure_future(sweep())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await gateway.close()

    app.cleanup_ctx.append(sweeper)
    return app
