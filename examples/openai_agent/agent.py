"""A search agent written only against the OpenAI API: it asks a model, runs the tool calls the
model makes, and returns the model's final answer. Nothing here knows about plexrl; point
``client`` at any OpenAI-compatible server (``job.openai()``'s, vLLM's, OpenAI's).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from openai import AsyncOpenAI

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the corpus of facts (BM25); returns the best matching facts.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


async def answer(
    client: AsyncOpenAI,
    model: str,
    question: str,
    search: Callable[[str], Awaitable[str]],
    *,
    max_turns: int = 4,
    temperature: float = 1.0,
    extra_headers: dict[str, str] | None = None,
) -> str:
    """Ask ``question``; run ``search`` for every tool call, until the model answers (or the turns
    run out: then the answer is empty)."""
    messages: list[Any] = [{"role": "user", "content": question}]
    for _ in range(max_turns):
        out = await client.chat.completions.create(
            model=model, messages=messages, tools=[SEARCH_TOOL], temperature=temperature, extra_headers=extra_headers
        )
        reply = out.choices[0].message
        if not reply.tool_calls:
            return reply.content or ""
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls:
            query = json.loads(call.function.arguments).get("query", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": await search(query)})
    return ""
