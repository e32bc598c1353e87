"""The endpoint's tool-call parsers: OpenAI tool calls out of sampled text (Hermes JSON blocks,
Search-R1 tags), with what does not parse left in the content."""

from __future__ import annotations

import json

import pytest

from plexrl.endpoint.tools import ToolCall, hermes, parser, tags
from plexrl.errors import InvalidRequestError
from plexrl.tasks.search import SEARCH_TOOL

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object",
           "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}  # fmt: skip


def test_hermes_reads_each_json_call_and_keeps_the_text_around_them() -> None:
    text = ('Let me look.\n<tool_call>\n{"name": "search", "arguments": {"query": "zorvan"}}\n</tool_call>\n'
            '<tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"tesk\\"}"}</tool_call>')  # fmt: skip
    parsed = hermes(text, [SEARCH_TOOL, WEATHER])
    assert parsed.calls == [
        ToolCall("search", json.dumps({"query": "zorvan"})),
        ToolCall("weather", '{"city": "tesk"}'),
    ]
    assert parsed.content == "Let me look."


@pytest.mark.parametrize(
    "call",
    [
        '{"name": "search", "arguments": {"query": ',
        '{"name": "delete_all", "arguments": {}}',
        '["search"]',
        '{"name": "search", "arguments": [1]}',
    ],
)
def test_a_hermes_call_that_does_not_parse_stays_in_the_content(call: str) -> None:
    text = f"<tool_call>{call}</tool_call>"
    parsed = hermes(text, [SEARCH_TOOL])
    assert parsed.calls == [] and parsed.content == text


def test_tags_makes_a_declared_tools_tag_a_call_with_its_first_parameter() -> None:
    parsed = tags("<search>zorvan</search>\n<weather>tesk</weather><answer>mara</answer>", [SEARCH_TOOL, WEATHER])
    assert parsed.calls == [ToolCall("search", '{"query": "zorvan"}'), ToolCall("weather", '{"city": "tesk"}')]
    assert parsed.content == "<answer>mara</answer>"  # an undeclared tag is text
    assert tags("<search>zorvan", [SEARCH_TOOL]).calls == []  # unclosed: no call


def test_an_unknown_parser_lists_the_known_ones() -> None:
    with pytest.raises(InvalidRequestError, match="hermes, tags"):
        parser("mistral")
