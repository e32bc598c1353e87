"""``job.openai()`` through real processes, driven by the ``openai`` SDK: an agent that knows
nothing of plexrl searches through a tool (the shipped model writes Search-R1's ``<search>`` tags;
the endpoint's ``tags`` parser makes them OpenAI tool calls), streamed and not; each session is
recorded as a trajectory token for token what the engine sampled and was prompted with; the job
trains on those trajectories; and another tenant's key is refused."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import openai
import pytest

import plexrl
from plexrl.endpoint import tenant_token
from plexrl.models import TINY_MODEL
from plexrl.protocol import auth
from plexrl.tasks import get_task
from plexrl.tasks.search import CHAT_TEMPLATE, SEARCH_TOOL, TURN_END, question, search_text

SEARCH = get_task("search")


def renderer() -> plexrl.Renderer:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    tok.chat_template = CHAT_TEMPLATE
    return plexrl.Renderer(tok, turn_end=TURN_END)


async def agent(client: openai.AsyncOpenAI, q: str, session: str, *, stream: bool) -> tuple[str, list[Any]]:
    """A plain OpenAI tool-calling loop: ask, run the tool calls, repeat until an answer."""
    messages: list[Any] = [{"role": "user", "content": q}]
    replies = []
    for _ in range(4):
        kwargs: dict[str, Any] = {"model": "agent", "messages": messages, "tools": [SEARCH_TOOL], "temperature": 0.0,
                                  "extra_headers": {"X-Session-Id": session}, "extra_body": {"return_token_ids": True}}  # fmt: skip
        reply = await (_streamed(client, kwargs) if stream else _whole(client, kwargs))
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply["content"], "tool_calls": reply["tool_calls"] or None})
        if not reply["tool_calls"]:
            return reply["content"] or "", replies
        for call in reply["tool_calls"]:
            query = json.loads(call["function"]["arguments"])["query"]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": search_text(query)})
    return "", replies


async def _whole(client: openai.AsyncOpenAI, kwargs: dict[str, Any]) -> dict[str, Any]:
    out = await client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    calls = [c.model_dump() for c in choice.message.tool_calls or []]
    return {"content": choice.message.content, "tool_calls": calls, "token_ids": choice.token_ids,  # type: ignore[attr-defined]
            "prompt_token_ids": choice.prompt_token_ids, "finish_reason": choice.finish_reason}  # type: ignore[attr-defined]  # fmt: skip


async def _streamed(client: openai.AsyncOpenAI, kwargs: dict[str, Any]) -> dict[str, Any]:
    content, calls, extra, finish = "", {}, {}, None
    async for chunk in await client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for c in choice.delta.tool_calls or []:
            calls.setdefault(c.index, {"id": c.id, "type": "function", "function": {"name": "", "arguments": ""}})
            calls[c.index]["function"]["name"] += c.function.name or ""
            calls[c.index]["function"]["arguments"] += c.function.arguments or ""
        extra.update({k: v for k, v in (choice.model_extra or {}).items() if k.endswith("token_ids")})
        finish = choice.finish_reason or finish
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish,
            **extra}  # fmt: skip


@pytest.mark.asyncio
async def test_an_openai_agent_is_recorded_token_exactly_trained_on_and_other_tenants_are_refused() -> None:
    r = renderer()
    problems = [p for p in SEARCH.eval_set() if " of " in p.prompt or "live=" in p.prompt][
        :2
    ]  # questions it searches for
    spec = {"lora": plexrl.LoRA(rank=4), "optimizer": plexrl.AdamW(lr=1e-2), "seed": 3}
    cluster = plexrl.local(workers=1)
    async with cluster, plexrl.job("agent", TINY_MODEL, **spec) as job:
        async with (
            job.openai(r, tool_parser="tags") as endpoint,
            openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0) as client,
        ):
            assert [m.id for m in (await client.models.list()).data] == ["agent"]
            runs = await asyncio.gather(*(agent(client, question(p), f"s{i}", stream=i == 1)
                                          for i, p in enumerate(problems)))  # fmt: skip
            trajectories = [endpoint.finish(f"s{i}") for i in range(len(problems))]

            # A plain completion is a one-turn trajectory of the prompt's own tokens.
            prompt = problems[0].prompt
            done = await client.completions.create(model="agent", prompt=prompt, max_tokens=32, temperature=0.0,
                                                   extra_headers={"X-Session-Id": "plain"},
                                                   extra_body={"return_token_ids": True})  # fmt: skip
            (single,) = endpoint.finish("plain")
            assert single.prompt.tolist() == r.tokenizer.encode(prompt, add_special_tokens=True)
            assert done.choices[0].token_ids == single.turns[0].tokens.tolist()  # type: ignore[attr-defined]
            assert done.choices[0].text == r.text(single.turns[0].tokens) != ""

            # Another tenant's token, and a made-up one, are refused.
            assert cluster.keys is not None
            bob = auth.Credentials.load(auth.add_key(cluster.keys, "bob", "client"), cluster.keys / "coordinator.key")
            for key in (tenant_token(bob), "sk-not-a-tenant"):
                async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0) as intruder:
                    with pytest.raises(openai.AuthenticationError):
                        await intruder.models.list()

        for problem, (_, replies), (traj,) in zip(problems, runs, trajectories, strict=True):
            assert replies[0]["tool_calls"], "the shipped model searches before it answers"
            # The prompt is the template's rendering of the question; each reply is a turn: its
            # tokens are the ones sampled, its prompt the trajectory so far (observations included).
            assert traj.prompt.tolist() == r.render([{"role": "user", "content": question(problem)}],
                                                    add_generation_prompt=True)  # fmt: skip
            assert len(traj.turns) == len(replies)
            for k, (turn, reply) in enumerate(zip(traj.turns, replies, strict=True)):
                assert reply["token_ids"] == turn.tokens.tolist()
                before = [np.concatenate([t.tokens, t.observation]) for t in traj.turns[:k]]
                assert reply["prompt_token_ids"] == np.concatenate([traj.prompt, *before]).tolist()
            # What the model saw is the search task's own format, the tool results as <information>.
            text = r.text(traj.tokens)
            assert text.startswith("ask:") and "</search>\n<information>" in text
        assert any(answer.startswith("<answer>") for answer, _ in runs)  # (the model is only partly competent)

        # The job trains on the recorded trajectories (one group, rewards 1 and 0).
        batch = plexrl.trajectory_batch([t for (t,) in trajectories], [1.0, 0.0], [0, 0])
        result = await job.forward_backward(batch, "grpo")
        assert result.metrics["ratio_mean"] == 1.0  # the trainer's logprobs of the sampling weights
        assert result.metrics["logp_gap_max"] < 1e-3  # and the sampler's: the same tokens, fp32 both
        await job.optim_step()
