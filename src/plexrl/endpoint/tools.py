"""Tool calls in a sampled turn's text, by parser name, as the OpenAI API returns them.

``hermes``: Qwen2.5's, Qwen3's and NousResearch Hermes's format (what their chat templates
render), one JSON object per call::

    <tool_call>
    {"name": "search", "arguments": {"query": "zorvan"}}
    </tool_call>

``tags``: Search-R1's, a tag per declared tool whose text is the tool's one argument
(``<search>zorvan</search>`` calls ``search`` with its first parameter set to ``"zorvan"``).

A call that does not parse (bad JSON, an undeclared tool) is left in the content, as vLLM's
parsers leave it: the agent sees what the model wrote.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from plexrl.errors import InvalidRequestError


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (the OpenAI API's ``function.arguments``)


@dataclass(frozen=True)
class Parsed:
    content: str  # the text outside the calls, stripped
    calls: list[ToolCall]


Parser = Callable[[str, Sequence[dict[str, Any]]], Parsed]
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def hermes(text: str, tools: Sequence[dict[str, Any]]) -> Parsed:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of declared tools."""
    declared = {_name(t) for t in tools}
    calls, kept = [], []
    last = 0
    for m in _HERMES.finditer(text):
        call = _hermes_call(m[1], declared)
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last : m.start()])
        last = m.end()
    kept.append(text[last:])
    return Parsed("".join(kept).strip(), calls)


def tags(text: str, tools: Sequence[dict[str, Any]]) -> Parsed:
    """``<name>argument</name>`` for each declared tool (its first parameter gets the text)."""
    found: list[tuple[int, int, ToolCall]] = []
    for tool in tools:
        name, params = _name(tool), list(_parameters(tool))
        if not params:
            continue
        for m in re.finditer(rf"<{re.escape(name)}>(.*?)</{re.escape(name)}>", text, re.S):
            found.append((m.start(), m.end(), ToolCall(name, json.dumps({params[0]: m[1]}))))
    found.sort(key=lambda f: f[0])
    kept, last = [], 0
    for start, end, _ in found:
        kept.append(text[last:start])
        last = end
    kept.append(text[last:])
    return Parsed("".join(kept).strip(), [call for _, _, call in found])


PARSERS: dict[str, Parser] = {"hermes": hermes, "tags": tags}


def parser(name: str) -> Parser:
    """The parser called ``name``; an ``InvalidRequestError`` lists the valid names otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise InvalidRequestError(f"unknown tool_parser {name!r}; choose one of {', '.join(PARSERS)}") from None


def _hermes_call(body: str, declared: set[str]) -> ToolCall | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") not in declared:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(str(call["name"]), json.dumps(arguments))


def _name(tool: dict[str, Any]) -> str:
    return str(tool.get("function", tool).get("name", ""))


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool.get("function", tool).get("parameters") or {}
    return dict(params.get("properties") or {})
