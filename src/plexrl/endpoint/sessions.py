"""An agent's conversations as token-exact trajectories: what ``job.openai()`` records.

A session (named by the request's ``X-Session-Id`` header or ``user`` field) is one agent's
conversation. Its first chat request is rendered (the chat template, its tools, the generation
prompt) into a trajectory's prompt; each reply is one turn of that trajectory, sampled by the
job. A later request whose messages extend the conversation (the same messages, then the
assistant reply the endpoint gave, then new tool or user messages) continues the same trajectory:
the new messages are rendered on their own (``Renderer.continuation``) and appended as an
observation, masked out of the loss. So the trajectory is exactly what the sampler saw, turn
after turn, with no decode and re-encode. A request that does not extend it (the agent rewrote
its history, or changed its tools) starts a new trajectory in the same session.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from plexrl.client.trajectory import Trajectory, Turn
from plexrl.endpoint.tools import Parsed, Parser
from plexrl.errors import InvalidRequestError
from plexrl.text import Message, Renderer
from plexrl.types import SamplingParams

if TYPE_CHECKING:
    from plexrl.client.job import Job


@dataclass
class Reply:
    """One sampled turn, as the endpoint answers it."""

    message: Message  # the assistant message (content, tool_calls) returned to the agent
    turn: Turn
    parsed: Parsed
    finish_reason: str  # OpenAI's: "stop", "length" or "tool_calls"
    prompt_token_ids: list[int]  # the tokens the turn continued (the trajectory so far)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Session:
    id: str
    messages: list[Message] = field(default_factory=list)  # the conversation so far, replies included
    tools: list[dict[str, Any]] | None = None
    trajectory: Trajectory | None = None
    done: list[Trajectory] = field(default_factory=list)  # earlier trajectories of the session
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request at a time: turns are in order


class Sessions:
    """The sessions of one job's endpoint; :meth:`finish` hands a session's trajectories over."""

    def __init__(self, job: Job, renderer: Renderer, parser: Parser, *, max_tokens: int | None = None) -> None:
        self.job = job
        self.renderer = renderer
        self.parser = parser
        self.max_tokens = max_tokens  # a trajectory's budget in all (None: the model's positions)
        self._sessions: dict[str, Session] = {}
        self._calls = itertools.count()

    async def chat(
        self, session_id: str, messages: list[Message], tools: list[dict[str, Any]] | None, params: SamplingParams
    ) -> Reply:
        """Sample the assistant's next turn of ``messages`` in session ``session_id``."""
        if not messages:
            raise InvalidRequestError("messages: give at least one message")
        session = self._sessions.setdefault(session_id, Session(session_id))
        async with session.lock:
            return await self._chat(session, messages, tools, params)

    async def _chat(
        self, session: Session, messages: list[Message], tools: list[dict[str, Any]] | None, params: SamplingParams
    ) -> Reply:
        session_id = session.id
        traj = session.trajectory
        if (
            traj is not None
            and traj.stop_reason is None
            and tools == session.tools
            and _extends(messages, session.messages)
        ):
            traj.observe(self._continuation(session.messages, messages[len(session.messages) :], tools))
        else:
            if traj is not None:
                session.done.append(traj)
            traj = session.trajectory = self.job.trajectory(self._prompt(messages, tools), max_tokens=self.max_tokens)
            session.tools = tools
        prompt = traj.tokens.tolist()
        turn = await self._turn(session_id, traj, params)
        parsed = self.parser(self.renderer.text(turn.tokens), tools or [])
        message: Message = {"role": "assistant", "content": parsed.content or None}
        if parsed.calls:
            message["tool_calls"] = [
                {"id": f"call_{next(self._calls)}", "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in parsed.calls
            ]  # fmt: skip
        session.messages = [*messages, message]
        if self.renderer.chat and turn.finish_reason != "stop":  # no end-of-turn: no turn can follow it
            traj.stop("truncated")
        reason = "tool_calls" if parsed.calls else ("stop" if turn.finish_reason == "stop" else "length")
        return Reply(message, turn, parsed, reason, prompt)

    async def complete(self, session_id: str, prompt: str, params: SamplingParams) -> Reply:
        """A plain completion of ``prompt`` (the tokenizer's own special tokens, no template), its
        own one-turn trajectory in session ``session_id``."""
        session = self._sessions.setdefault(session_id, Session(session_id))
        tokens = self.renderer.tokenizer.encode(prompt, add_special_tokens=True)
        traj = self.job.trajectory(tokens, max_tokens=self.max_tokens)
        session.done.append(traj)
        turn = await self._turn(session_id, traj, params)
        text = self.renderer.text(turn.tokens)
        reason = "stop" if turn.finish_reason == "stop" else "length"
        return Reply({"role": "assistant", "content": text}, turn, Parsed(text, []), reason, tokens)

    async def _turn(self, session_id: str, traj: Trajectory, params: SamplingParams) -> Turn:
        turn = await traj.generate(params)
        if turn is None:
            raise InvalidRequestError(f"session {session_id!r}: its trajectory has stopped ({traj.stop_reason}): "
                                      "its budget is spent; start a new session")  # fmt: skip
        return turn

    def finish(self, session_id: str) -> list[Trajectory]:
        """A session's trajectories (usually one), in the order they were started; the session ends."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            raise InvalidRequestError(f"no session {session_id!r}: it made no chat request, or was finished")
        return [*session.done, *([session.trajectory] if session.trajectory is not None else [])]

    def _prompt(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> list[int]:
        if self.renderer.chat:
            return self.renderer.render(messages, tools=tools, add_generation_prompt=True)
        if len(messages) != 1 or messages[0].get("role") != "user":
            raise InvalidRequestError("without a chat template a conversation starts with one user message")
        return self.renderer.prompt(_text(messages[0]))

    def _continuation(self, before: list[Message], new: list[Message], tools: list[dict[str, Any]] | None) -> list[int]:
        if not new:
            raise InvalidRequestError("the request adds no message after the assistant's last reply")
        if self.renderer.chat:
            return self.renderer.continuation(before, new, tools=tools)
        return [t for m in new for t in self.renderer.observation(_text(m))]


def _text(message: Message) -> str:
    content = message.get("content")
    if isinstance(content, list):  # OpenAI's content parts: the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _extends(messages: list[Message], seen: list[Message]) -> bool:
    """Whether ``messages`` starts with the conversation ``seen`` (message by message, by the
    fields a template renders: role, text, tool calls' names and arguments)."""
    return len(messages) > len(seen) and all(_key(a) == _key(b) for a, b in zip(messages, seen, strict=False))


def _key(message: Message) -> tuple[Any, ...]:
    calls = tuple(
        (c.get("function", {}).get("name"), json.loads(c.get("function", {}).get("arguments") or "{}"))
        for c in message.get("tool_calls") or []
    )
    return message.get("role"), _text(message).strip(), json.dumps(calls, sort_keys=True)
