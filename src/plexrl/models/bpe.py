"""A Qwen3-shaped tokenizer made here (no model hub): byte-level BPE trained on the tasks' text,
Qwen3's special tokens at Qwen3's ids, its vocabulary size, and a ChatML chat template with
Hermes-style tool calls (the format of Qwen2.5's and Qwen3's templates, without thinking).

It is what tests and benchmarks of ``QWEN3_SHAPED_CONFIG`` models tokenize with: merges make
sub-word tokens (so a stop string can end inside one), the template renders system, user,
assistant (with ``tool_calls``) and ``tool`` turns, and every id the model can sample decodes
(ids between the trained tokens and the special ones are reserved tokens, as in Qwen's own
vocabulary).
"""

from __future__ import annotations

import json
from pathlib import Path

# Qwen3's special and tool tokens, at their ids in Qwen3's vocabulary.
SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}  # special: skipped in text
TOOL_TOKENS = {
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}  # fmt: skip  (ordinary added tokens: kept in text)

# ChatML with Hermes tool calls: tools in the system turn, an assistant's calls as
# <tool_call>{json}</tool_call> lines, a tool's answer as a user turn inside <tool_response>.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + fn.name + \'", "arguments": \' }}'
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def training_text() -> list[str]:
    """What the merges are learned from: every task's problems and answers, the search corpus,
    chat turns and tool calls."""
    import numpy as np

    from plexrl.tasks import TASKS
    from plexrl.tasks.search import corpus

    rng = np.random.default_rng(0)
    texts = [p.prompt + p.answer for task in TASKS.values() for p in task.sample(300, rng)]
    texts += [d.text for d in corpus()]
    texts += [
        f'<tool_call>\n{{"name": "search", "arguments": {{"query": "{d.title}"}}}}\n</tool_call>' for d in corpus()
    ]
    texts += ["You are a helpful assistant. Answer the question; call a tool when you need to.", CHAT_TEMPLATE]
    return texts


def write_qwen3_tokenizer(path: str | Path, *, vocab_size: int = 151936, merges_vocab: int = 2048) -> Path:
    """Train the tokenizer (``merges_vocab`` learned tokens) and save it into directory ``path``
    with ``save_pretrained`` (so ``AutoTokenizer.from_pretrained(path)`` and vLLM load it). Ids
    between the learned tokens and ``vocab_size`` that Qwen3 does not name are reserved tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    trainer = trainers.BpeTrainer(vocab_size=merges_vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    learner.train_from_iterator(training_text(), trainer)
    learned = json.loads(learner.to_str())["model"]
    named = {**SPECIAL, **TOOL_TOKENS}
    vocab: dict[str, int] = dict(learned["vocab"])
    ids = set(vocab.values())
    by_id = {i: t for t, i in named.items()}
    for i in range(vocab_size):
        if i not in ids:
            vocab[by_id.get(i, f"<|reserved_{i}|>")] = i
    pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in learned["merges"]]
    merges = [(a, b) for a, b in pairs]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE, model_max_length=40960)  # fmt: skip
    fast.save_pretrained(str(path))
    return path
