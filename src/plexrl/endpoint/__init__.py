"""An OpenAI-compatible endpoint for one job, recording what its agents sample as trajectories::

    async with job.openai(renderer, tool_parser="hermes") as endpoint:
        client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)
        answer = await my_agent(client, question, session="q17-0")  # any OpenAI-API agent
        (traj,) = endpoint.finish("q17-0")                           # a plexrl.Trajectory
    batch = plexrl.trajectory_batch(trajectories, rewards, groups)

The endpoint serves the job's current weights under the job's name as ``model``, in the script's
own process (aiohttp on its event loop; ``host="0.0.0.0"`` for agents on other machines). Its
``api_key`` is the tenant's token (derived from the client's key, so another tenant's token is
refused; a random one where the client has no key). What each session sampled is a token-exact
trajectory (``plexrl.endpoint.sessions``); a session's turns keep one trajectory name, so a pooled
job runs them on one rollout worker and its prefix cache serves the conversation so far.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import TYPE_CHECKING, Any

from plexrl.client.trajectory import Trajectory
from plexrl.endpoint.sessions import Sessions
from plexrl.endpoint.tools import PARSERS, parser
from plexrl.errors import TokenizerError
from plexrl.text import Renderer

if TYPE_CHECKING:
    from aiohttp import web

    from plexrl.client.job import Job
    from plexrl.protocol.auth import Credentials

__all__ = ["PARSERS", "Endpoint", "tenant_token"]

BACKLOG = 4096  # connections waiting to be accepted: a harness may open hundreds of sessions at once


def tenant_token(credentials: Credentials | None) -> str:
    """The API key a tenant's endpoints take: an HMAC of its secret key (the same for all its
    endpoints, different for every tenant); a fresh random one for a client without a key."""
    if credentials is None:
        return "plexrl-" + secrets.token_hex(20)
    return "plexrl-" + hmac.new(credentials.pair.secret, b"plexrl openai endpoint", hashlib.sha256).hexdigest()[:40]


class Endpoint:
    """``job.openai(...)``: serves while entered; ``base_url``, ``api_key``, :meth:`finish`."""

    def __init__(
        self,
        job: Job,
        renderer: Renderer | None = None,
        *,
        tool_parser: str = "hermes",
        host: str = "127.0.0.1",
        port: int = 0,
        max_tokens: int = 512,
        trajectory_max_tokens: int | None = None,
    ) -> None:
        self.job = job
        self.renderer = renderer or _renderer_of(job.spec.model)
        self.sessions = Sessions(job, self.renderer, parser(tool_parser), max_tokens=trajectory_max_tokens)
        self.host, self.port = host, port
        self.max_tokens = max_tokens  # a reply's budget when a request names none
        self.api_key = tenant_token(job.client.credentials)
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def finish(self, session: str) -> list[Trajectory]:
        """End session ``session`` and return its trajectories (one unless the agent rewrote its
        history mid-way), ready for ``plexrl.trajectory_batch``."""
        return self.sessions.finish(session)

    async def __aenter__(self) -> Endpoint:
        from aiohttp import web

        from plexrl.endpoint.app import make_app

        app = make_app(self.sessions, model=self.job.name, api_key=self.api_key, max_tokens=self.max_tokens)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=BACKLOG)
        await site.start()
        self.port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]  # port 0: the one bound
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def _renderer_of(model: str) -> Renderer:
    try:
        from transformers import AutoTokenizer

        return Renderer(AutoTokenizer.from_pretrained(model))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot load the tokenizer of {model!r} here ({e}): pass renderer=plexrl.Renderer("
                             "AutoTokenizer.from_pretrained(...)) to job.openai()") from e  # fmt: skip
