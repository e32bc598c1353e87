"""The tokenizer protocol (``plexrl.text``) with the shipped character tokenizer and with a
Qwen3-shaped byte-level BPE tokenizer trained here, through its Jinja chat template: prompts,
observations and whole conversations are token-exact with what the template renders, stop
strings are matched on text, and the tasks score the text of either tokenizer's tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from plexrl.errors import TokenizerError
from plexrl.models import CharTokenizer
from plexrl.models.bpe import SPECIAL, TOOL_TOKENS, write_qwen3_tokenizer
from plexrl.rollout import turn_params
from plexrl.tasks import TASKS, get_task
from plexrl.text import Renderer, stop_index, stop_token_ids

IM_END, ENDOFTEXT = SPECIAL["<|im_end|>"], SPECIAL["<|endoftext|>"]
SEARCH_TOOL = {"type": "function", "function": {"name": "search", "description": "Search the corpus.",
               "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}  # fmt: skip


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(write_qwen3_tokenizer(tmp_path_factory.mktemp("qwen3-tokenizer")))


def test_the_trained_tokenizer_has_qwen3s_ids_merges_and_every_id_decodes(bpe: Any) -> None:
    assert len(bpe) == 151936 and bpe.eos_token_id == IM_END and bpe.bos_token_id is None
    assert all(bpe.convert_tokens_to_ids(t) == i for t, i in {**SPECIAL, **TOOL_TOKENS}.items())
    ids = bpe.encode("ask:who rules the land where zorvan lives=", add_special_tokens=False)
    assert len(ids) < 20  # merged: far fewer tokens than characters
    assert bpe.decode(ids) == "ask:who rules the land where zorvan lives="
    assert bpe.decode([151935, 5000]) == "<|reserved_151935|><|reserved_5000|>"


def test_plain_text_with_the_character_tokenizer() -> None:
    r = Renderer(CharTokenizer())
    assert not r.chat and r.stop_token_ids == (CharTokenizer.eos_token_id,)
    assert r.prompt("12+3=") == CharTokenizer().encode("12+3=")  # BOS first
    assert r.observation("<information>") == CharTokenizer().encode("<information>", add_special_tokens=False)
    assert r.text([1, *CharTokenizer().encode("15", add_special_tokens=False), 2]) == "15"
    with pytest.raises(TokenizerError, match="chat_template"):
        Renderer(CharTokenizer(), chat=True)


def test_stop_ids_are_eos_and_the_end_of_turn_tokens_not_pieces_of_a_stop_string(bpe: Any) -> None:
    assert stop_token_ids(bpe) == (ENDOFTEXT, IM_END)
    search = get_task("search")
    raw = turn_params(search, Renderer(bpe, chat=False))
    # The turn marker is a stop string: a token such as ">\n" that merely contains it ends the
    # turn too, and no sub-token of it (the old encode-the-marker rule) is a stop id.
    assert raw.stop == ("\n",) and raw.stop_token_ids == (ENDOFTEXT, IM_END)
    chat = turn_params(search, Renderer(bpe))
    assert chat.stop == () and chat.stop_token_ids == (ENDOFTEXT, IM_END)  # a chat turn ends at <|im_end|>


def test_a_conversation_built_turn_by_turn_is_the_template_rendering_of_it(bpe: Any) -> None:
    """The prompt, then each sampled turn (its tokens as sampled, ended by <|im_end|>) and the
    rendered observation after it: exactly what the template renders for the whole conversation."""
    r = Renderer(bpe, system="Answer with a search.")
    question, turns = "ask:where does zorvan live=", ["<search>zorvan</search>", "<answer>pelmora</answer>"]
    observation = "<information>zorvan: zorvan lives in pelmora</information>"
    tokens = r.prompt(question)
    tokens += [*bpe.encode(turns[0], add_special_tokens=False), IM_END]  # as a sampler would end it
    tokens += r.observation(observation)
    tokens += [*bpe.encode(turns[1], add_special_tokens=False), IM_END]
    messages = [{"role": "system", "content": "Answer with a search."}, {"role": "user", "content": question},
                {"role": "assistant", "content": turns[0]}, {"role": "tool", "content": observation},
                {"role": "assistant", "content": turns[1]}]  # fmt: skip
    rendered = r.render(messages, add_generation_prompt=False)
    assert tokens == rendered[: len(tokens)] and bpe.decode(rendered[len(tokens) :]) == "\n"
    assert r.text(tokens).endswith("<answer>pelmora</answer>") and "<|im_end|>" not in r.text(tokens)


def test_tool_call_turns_continue_token_exactly(bpe: Any) -> None:
    r = Renderer(bpe)
    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "zorvan"}'}}
    messages = [{"role": "user", "content": "ask:where does zorvan live="},
                {"role": "assistant", "content": "", "tool_calls": [call]}]  # fmt: skip
    new = [{"role": "tool", "tool_call_id": "c1", "content": "zorvan lives in pelmora"}]
    before = r.render(messages[:1], tools=[SEARCH_TOOL], add_generation_prompt=True)
    call_text = '<tool_call>\n{"name": "search", "arguments": {"query": "zorvan"}}\n</tool_call>'
    sampled = [*bpe.encode(call_text, add_special_tokens=False), IM_END]
    assert TOOL_TOKENS["<tool_call>"] in sampled  # one token, as in Qwen's vocabulary
    after = r.continuation(messages, new, tools=[SEARCH_TOOL])
    assert before + sampled + after == r.render([*messages, *new], tools=[SEARCH_TOOL], add_generation_prompt=True)


def test_a_template_that_rewrites_earlier_turns_is_refused(bpe: Any) -> None:
    r = Renderer(bpe)
    r.tokenizer = _with_template(
        bpe, "{{ messages | length }}{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}"
    )
    with pytest.raises(TokenizerError, match="renders the earlier turns differently"):
        r.observation("x")


def test_a_stop_string_is_matched_on_text_inside_and_across_tokens(bpe: Any) -> None:
    ids = bpe.encode("<search>zorvan</search>\n<information>", add_special_tokens=False)
    texts = [bpe.decode([t]) for t in ids]
    k = next(i for i, t in enumerate(texts) if "\n" in t)
    assert stop_index(bpe.decode, ids, ["\n"]) == k + 1
    # a string ending inside a token keeps that whole token; one spanning tokens, the last it needs
    inside = next(i for i, t in enumerate(texts) if len(t) > 2)
    prefix = "".join(texts[:inside]) + texts[inside][:2]
    assert stop_index(bpe.decode, ids, [prefix[-3:]]) == inside + 1
    assert stop_index(bpe.decode, ids, ["never"]) is None and stop_index(bpe.decode, ids, []) is None


@pytest.mark.parametrize("task", list(TASKS))
def test_every_task_scores_either_tokenizers_tokens_of_its_answer(task: str, bpe: Any) -> None:
    t = get_task(task)
    for tokenizer in (CharTokenizer(), bpe):
        r = Renderer(tokenizer, chat=False)
        for p in t.sample(20, np.random.default_rng(0)):
            answer = [*tokenizer.encode(p.answer, add_special_tokens=False), int(tokenizer.eos_token_id)]
            assert t.score(p, r.text(answer)) == 1.0


def _with_template(tokenizer: Any, template: str) -> Any:
    import copy

    clone = copy.deepcopy(tokenizer)
    clone.chat_template = template
    return clone


def test_bpe_tokenizer_files_load_where_the_model_does(tmp_path: Path) -> None:
    from plexrl.worker.models import has_tokenizer

    assert not has_tokenizer(str(tmp_path))
    write_qwen3_tokenizer(tmp_path, vocab_size=4096, merges_vocab=512)
    assert has_tokenizer(str(tmp_path))
