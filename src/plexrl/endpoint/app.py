"""The HTTP side of ``job.openai()`` (aiohttp): OpenAI's ``/v1/models``, ``/v1/chat/completions``
and ``/v1/completions``, answered from the job's sessions.

Every request needs ``Authorization: Bearer <the endpoint's api_key>`` (the tenant's token). A
session is named by the ``X-Session-Id`` header or the body's ``user`` field (a request with
neither gets a session of its own); its id comes back in the ``X-Session-Id`` response header
and the body's ``plexrl`` field. ``stream: true`` answers as server-sent events: plexrl samples a
turn whole, so the content (and tool calls) arrive as one delta, then the finish reason and
``[DONE]``. ``return_token_ids: true`` (vLLM's extension) adds the prompt's and completion's token
ids to a choice; ``logprobs: true`` adds each sampled token's logprob.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from plexrl.endpoint.sessions import Reply, Sessions
from plexrl.errors import InvalidRequestError, PlexError
from plexrl.types import SamplingParams

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SESSIONS = web.AppKey("sessions", Sessions)
CONFIG = web.AppKey("config", dict)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.headers.get("Authorization", "") != f"Bearer {request.app[CONFIG]['api_key']}":
        return _error(401, "send the endpoint's api_key (Authorization: Bearer ...): endpoint.api_key, the "
                           "job's tenant token", "authentication_error")  # fmt: skip
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except (PlexError, ValueError, KeyError, TypeError) as e:
        return _error(400, f"{type(e).__name__}: {e}")


def make_app(sessions: Sessions, *, model: str, api_key: str, max_tokens: int) -> web.Application:
    app = web.Application(middlewares=[_auth], client_max_size=64 << 20)
    app[SESSIONS] = sessions
    app[CONFIG] = {"model": model, "api_key": api_key, "max_tokens": max_tokens}
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    return app


async def _models(request: web.Request) -> web.Response:
    model = request.app[CONFIG]["model"]
    return web.json_response({"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                                          "owned_by": "plexrl"}]})  # fmt: skip


async def _chat(request: web.Request) -> web.StreamResponse:
    body, session = await _body(request)
    tools = body.get("tools") or None
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise InvalidRequestError("tool_choice: only 'auto' (or 'none') is served; the model decides")
    reply = await request.app[SESSIONS].chat(session, list(body["messages"]), tools, _params(request, body))
    choice: dict[str, Any] = {"index": 0, "message": reply.message, "finish_reason": reply.finish_reason}
    _extras(choice, body, reply)
    payload = _envelope("chat.completion", request, session, reply, [choice])
    if not body.get("stream"):
        return _json(payload, session)
    delta = {k: v for k, v in reply.message.items() if v is not None}
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(delta["tool_calls"])]
    first = {**choice, "delta": delta, "finish_reason": None}
    del first["message"]
    last = {"index": 0, "delta": {}, "finish_reason": reply.finish_reason}
    chunks = [_envelope("chat.completion.chunk", request, session, reply, [c]) for c in (first, last)]
    chunks[-1]["usage"] = payload["usage"]
    return await _stream(request, session, chunks)


async def _completions(request: web.Request) -> web.StreamResponse:
    body, session = await _body(request)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidRequestError("prompt: one string (token-id prompts and lists are not served)")
    reply = await request.app[SESSIONS].complete(session, prompt, _params(request, body))
    choice: dict[str, Any] = {"index": 0, "text": reply.parsed.content, "finish_reason": reply.finish_reason}
    _extras(choice, body, reply)
    payload = _envelope("text_completion", request, session, reply, [choice])
    if not body.get("stream"):
        return _json(payload, session)
    last = {"index": 0, "text": "", "finish_reason": reply.finish_reason}
    chunks = [
        _envelope("text_completion", request, session, reply, [c]) for c in ({**choice, "finish_reason": None}, last)
    ]
    return await _stream(request, session, chunks)


async def _body(request: web.Request) -> tuple[dict[str, Any], str]:
    try:
        body = await request.json()
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    model = request.app[CONFIG]["model"]
    if body.get("model") not in (None, model):
        raise InvalidRequestError(f"model {body.get('model')!r}: this endpoint serves {model!r} (GET /v1/models)")
    if int(body.get("n") or 1) != 1:
        raise InvalidRequestError("n: one choice per request (send n requests, each its own session, for a group)")
    session = request.headers.get("X-Session-Id") or body.get("user") or f"s-{uuid.uuid4().hex[:12]}"
    return body, str(session)


def _params(request: web.Request, body: dict[str, Any]) -> SamplingParams:
    stop = body.get("stop") or ()
    renderer = request.app[SESSIONS].renderer
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or request.app[CONFIG]["max_tokens"]
    params = renderer.turn(max_tokens=int(max_tokens), temperature=float(body.get("temperature", 1.0)),
                           stop=(stop,) if isinstance(stop, str) else tuple(stop))  # fmt: skip
    seed = body.get("seed")
    return msgspec.structs.replace(
        params, top_p=float(body.get("top_p", 1.0)), seed=None if seed is None else int(seed)
    )


def _extras(choice: dict[str, Any], body: dict[str, Any], reply: Reply) -> None:
    if body.get("logprobs"):
        choice["logprobs"] = {"content": [{"token_id": int(t), "logprob": float(lp)}
                                          for t, lp in zip(reply.turn.tokens, reply.turn.logprobs, strict=True)]}  # fmt: skip
    if body.get("return_token_ids"):
        choice["token_ids"] = [int(t) for t in reply.turn.tokens]
        choice["prompt_token_ids"] = reply.prompt_token_ids


def _envelope(kind: str, request: web.Request, session: str, reply: Reply, choices: list[Any]) -> dict[str, Any]:
    completion = len(reply.turn.tokens)
    return {
        "id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex[:16]}",
        "object": kind,
        "created": int(time.time()),
        "model": request.app[CONFIG]["model"],
        "choices": choices,
        "usage": {
            "prompt_tokens": reply.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": reply.prompt_tokens + completion,
        },
        "plexrl": {"session": session, "weight_version": reply.turn.weight_version},
    }


def _json(payload: dict[str, Any], session: str) -> web.Response:
    return web.json_response(payload, headers={"X-Session-Id": session})


async def _stream(request: web.Request, session: str, chunks: list[dict[str, Any]]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Session-Id": session})  # fmt: skip
    await response.prepare(request)
    for chunk in chunks:
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
