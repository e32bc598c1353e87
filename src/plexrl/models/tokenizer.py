"""The character tokenizer of plexrl's shipped task model: one id per character, no merges.

Pure Python so ``import plexrl`` stays light. :func:`write_hf_tokenizer` saves the same vocabulary
as Hugging Face tokenizer files, so ``transformers.AutoTokenizer.from_pretrained(model_dir)`` (and
samplers that load tokenizers that way) encode exactly as :class:`CharTokenizer` does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"  # how ``decode(ids)`` renders EOS (``skip_special_tokens=True`` drops it)
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)  # ids 0, 1, 2: TINY_CONFIG's pad, bos, eos

# Every character the tasks use, ids 3.. in this order, then (ids 52-58, appended after tiny-arith
# was pretrained, so it never saw them) what chat renderers write around a question, such as the
# Tinker cookbook's "User: What is 4 + 5?\n\nAssistant:". Append only: reordering changes the ids a
# trained model was made with.
ALPHABET = "0123456789+-*/=:>(), abcdefghijklmnopqrstuvwxyz<\n" + "?.ASTUW"
VOCAB_SIZE = 64  # TINY_CONFIG's vocab_size; the ids after the alphabet are reserved tokens
# A model samples from all VOCAB_SIZE ids, so the unused ones decode to visible (never rewarded) text.
RESERVED_TOKENS = tuple(f"<unused{i}>" for i in range(len(SPECIAL_TOKENS) + len(ALPHABET), VOCAB_SIZE))


class CharTokenizer:
    """Text to token ids and back, one id per character of :data:`ALPHABET`.

    Ids 0-2 are pad, bos and eos; the ids after the alphabet, up to :data:`VOCAB_SIZE`, are
    :data:`RESERVED_TOKENS`: never produced by ``encode``, decoded as ``<unusedN>``. Its methods
    and attributes are those of a transformers tokenizer (``plexrl.text.Tokenizer``), so whatever
    takes one takes the other.
    """

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    chat_template = None  # the shipped model reads plain text (``plexrl.text.Renderer`` says how)

    def __init__(self) -> None:
        self._id_of = {ch: i for i, ch in enumerate(ALPHABET, start=len(SPECIAL_TOKENS))}
        self._char_of = dict(enumerate((*SPECIAL_TOKENS, *ALPHABET, *RESERVED_TOKENS)))

    @property
    def vocab_size(self) -> int:
        return len(self._char_of)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, led by BOS unless ``add_special_tokens=False``; no EOS is added."""
        ids = [self.bos_token_id] if add_special_tokens else []
        for ch in text:
            i = self._id_of.get(ch)
            if i is None:
                raise ValueError(f"character {ch!r} in {text!r} is not in the tokenizer's alphabet {ALPHABET!r}")
            ids.append(i)
        return ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids``: pad, bos and eos as :data:`SPECIAL_TOKENS` spell them, or left
        out with ``skip_special_tokens=True``."""
        chars = []
        for i in token_ids:
            i = int(i)
            ch = self._char_of.get(i)
            if ch is None:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            if not (skip_special_tokens and i < len(SPECIAL_TOKENS)):
                chars.append(ch)
        return "".join(chars)

    def get_vocab(self) -> dict[str, int]:
        """Token string to id, special tokens included."""
        return {tok: i for i, tok in self._char_of.items()}


def write_hf_tokenizer(path: str | Path, tokenizer: CharTokenizer | None = None) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for ``tokenizer`` into directory ``path``.

    Byte-level BPE with no merges, so every character is its own token, plus a BOS-prepending
    post-processor. It is byte-level (space is stored as ``"Ġ"``) because transformers 5 loads
    any ``qwen2`` model directory with ``Qwen2Tokenizer``, which keeps the vocabulary and
    post-processor of ``tokenizer.json`` but imposes its own byte-level pre-tokenizer and decoder:
    written this way, ``AutoTokenizer`` encodes (BOS included) and decodes like
    :class:`CharTokenizer` both there and in a directory without a model config. Unlike
    ``CharTokenizer``, it drops characters outside the alphabet instead of raising.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tok = tokenizer or CharTokenizer()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = {
        (token if token in SPECIAL_TOKENS or token in RESERVED_TOKENS else _byte_level(token)): i
        for token, i in tok.get_vocab().items()
    }
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, tok.bos_token_id)]
    )
    hf.add_special_tokens(list(SPECIAL_TOKENS))
    hf.add_tokens(list(RESERVED_TOKENS))  # not special: decoding keeps them, as CharTokenizer does
    hf.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,  # Qwen2Tokenizer would otherwise add "<|endoftext|>" as a 65th token
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "padding_side": "left",  # for batched generation
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return path


def _byte_level(ch: str) -> str:
    """``ch`` (one ASCII character) as GPT-2's byte-level BPE spells it: printable ones as themselves."""
    b = ord(ch)
    if b > 0x7F:
        raise ValueError(f"byte-level spelling is only defined here for ASCII, not {ch!r}")
    if 0x21 <= b <= 0x7E:
        return ch
    # GPT-2's bytes_to_unicode: the unprintable ASCII bytes 0-32 and 127 map to U+0100 onwards, in order.
    return chr(0x100 + (b if b <= 0x20 else 0x21))
