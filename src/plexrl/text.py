"""Text to tokens and back for the client's helpers, for any tokenizer: a transformers one (its
chat template included) or the shipped ``CharTokenizer``.

    renderer = Renderer(AutoTokenizer.from_pretrained(model_dir))  # its chat template, if it has one
    prompt = renderer.prompt("what is 2+2?")     # the user turn and the assistant's generation prompt
    params = renderer.turn(max_tokens=64)         # ends at the end-of-turn ids (and any stop strings)
    ...                                           # sample a turn; a tool answers it
    traj.observe(renderer.observation(result))    # the tool turn's tokens, appended to what was sampled
    reward = task.score(problem, renderer.text(tokens))

What is sampled is never decoded and re-encoded: a turn's tokens stay exactly as the sampler
returned them, and what follows a turn (a tool result, the next user message) is rendered on its
own and appended. For a chat template that is the difference between the conversation rendered
with and without the new messages (:meth:`Renderer.continuation`), which must extend the tokens
sampled so far; a template that rewrites earlier turns (Qwen3's, which drops earlier turns'
thinking) is refused with a :class:`~plexrl.errors.TokenizerError` rather than trained on tokens
the sampler never saw.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from plexrl.errors import TokenizerError
from plexrl.types import SamplingParams

Message = dict[str, Any]  # an OpenAI-style chat message: {"role": ..., "content": ..., "tool_calls": ...}

# Tokens that end a chat turn in the common templates (Qwen/ChatML, Llama 3, Gemma, Phi): stops
# besides EOS, since a base model's generation config often names only its end-of-text token.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>",
                      "<|end_of_text|>")  # fmt: skip


class Tokenizer(Protocol):
    """What the helpers use of a tokenizer, by transformers' names: any ``AutoTokenizer`` is one,
    and so is ``plexrl.models.CharTokenizer``."""

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def bos_token_id(self) -> int | None: ...

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = ...) -> str | list[str]: ...

    def get_vocab(self) -> dict[str, int]: ...


def stop_token_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """EOS and every end-of-turn token (:data:`END_OF_TURN_TOKENS`) the vocabulary has."""
    vocab = tokenizer.get_vocab()
    ids = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def stop_index(decode: Any, tokens: Sequence[int], stops: Sequence[str]) -> int | None:
    """How many of ``tokens`` to keep when cutting at the first stop string: up to and including
    the token whose text completes one (None: none is complete). Matched on decoded text, so a stop
    string may end inside a token or span several; ``decode``: ``tokenizer.decode``."""
    if not stops:
        return None
    for k in range(1, len(tokens) + 1):
        text = decode(list(tokens[:k]))
        if any(s in text for s in stops):
            return k
    return None


class Renderer:
    """How a task's text becomes tokens for one tokenizer: as plain text (``chat=False``: the
    prompt is BOS and the text) or through the tokenizer's chat template (``chat=True``, the
    default when it has one: the prompt is a user turn and the generation prompt, a tool's answer a
    ``tool`` turn). ``system``: a system message before every conversation (chat only).
    ``turn_end``: a chat format whose assistant turns end with this text rather than an
    end-of-turn token (Search-R1's newline); it must be one token that the tokenizer never
    merges with its neighbours (a special token, or any token of a character tokenizer)."""

    def __init__(
        self, tokenizer: Tokenizer, *, chat: bool | None = None, system: str | None = None, turn_end: str | None = None
    ) -> None:
        template = getattr(tokenizer, "chat_template", None)
        self.chat = bool(template) if chat is None else chat
        if self.chat and not template:
            raise TokenizerError("chat=True needs a tokenizer with a chat_template (set tokenizer.chat_template "
                                 "to a Jinja template, or render plain text with chat=False)")  # fmt: skip
        if system is not None and not self.chat:
            raise TokenizerError("a system message needs chat=True: plain text has no roles")
        self.tokenizer = tokenizer
        self.system = system
        self.stop_token_ids = stop_token_ids(tokenizer)
        if turn_end is not None:
            ids = tokenizer.encode(turn_end, add_special_tokens=False)
            if not self.chat or len(ids) != 1:
                raise TokenizerError(f"turn_end={turn_end!r} must be one token ({ids}) of a chat format; end "
                                     "plain-text turns with SamplingParams.stop instead")  # fmt: skip
            self.stop_token_ids = tuple(sorted({*self.stop_token_ids, ids[0]}))

    def prompt(self, text: str) -> list[int]:
        """The tokens a first turn continues: ``text`` as the user's message, or as plain text."""
        if not self.chat:
            return self.tokenizer.encode(text, add_special_tokens=True)
        return self.render(self._opening(text), add_generation_prompt=True)

    def observation(self, text: str, *, role: str = "tool") -> list[int]:
        """The tokens of ``text`` following a turn that ended at an end-of-turn id (plain text: the
        text alone; chat: a ``role`` turn, then the assistant's generation prompt)."""
        if not self.chat:
            return self.tokenizer.encode(text, add_special_tokens=False)
        # Templates render a turn alike whatever came before it, so a stand-in conversation gives
        # the tokens of the new turn (verl's "fixed base"; checked below to extend it).
        base = [*self._opening("?"), {"role": "assistant", "content": "?"}]
        return self.continuation(base, [{"role": role, "content": text}])

    def continuation(self, messages: list[Message], new: list[Message], *, tools: list[Any] | None = None) -> list[int]:
        """The tokens that follow an assistant turn the sampler ended at an end-of-turn id, when the
        conversation ``messages`` (ending with that turn) goes on with ``new``: what the template
        writes after the end-of-turn token (often a newline), the new turns, then the generation
        prompt. Raises :class:`TokenizerError` if the template does not extend the conversation."""
        before = self.render(messages, tools=tools, add_generation_prompt=False)
        after = self.render([*messages, *new], tools=tools, add_generation_prompt=True)
        if after[: len(before)] != before:
            raise TokenizerError("the chat template renders the earlier turns differently once new ones follow "
                                 "(e.g. it drops their thinking): their sampled tokens would not be what is "
                                 "trained on; use a template that only appends")  # fmt: skip
        ends = [i for i, t in enumerate(before) if t in self.stop_token_ids]
        if not ends:
            raise TokenizerError(f"the chat template ends no assistant turn with a stop token {self.stop_token_ids}: "
                                 "cannot tell where a sampled turn ends in it")  # fmt: skip
        return before[ends[-1] + 1 :] + after[len(before) :]

    def render(
        self, messages: list[Message], *, tools: list[Any] | None = None, add_generation_prompt: bool
    ) -> list[int]:
        """``messages`` through the chat template, as token ids (the template writes any BOS)."""
        if not self.chat:
            raise TokenizerError("render() is for chat templates; this renderer writes plain text (chat=False)")
        apply: Any = getattr(self.tokenizer, "apply_chat_template")  # noqa: B009 (not in the protocol)
        text = apply(messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def turn(self, *, max_tokens: int, temperature: float = 1.0, stop: Sequence[str] = ()) -> SamplingParams:
        """One turn's sampling: ends at EOS or an end-of-turn id, or at one of the ``stop`` strings."""
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, stop_token_ids=self.stop_token_ids,
                              stop=tuple(stop))  # fmt: skip

    def text(self, tokens: Iterable[int]) -> str:
        """What a task scores: the text of ``tokens`` without special tokens (BOS, EOS, end of turn)."""
        text = self.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=True)
        return text if isinstance(text, str) else "".join(text)

    def _opening(self, text: str) -> list[Message]:
        system = [] if self.system is None else [{"role": "system", "content": self.system}]
        return [*system, {"role": "user", "content": text}]
