"""The character tokenizer, and its Hugging Face twin in the shipped model's directory."""

from pathlib import Path

import numpy as np
import pytest

from plexrl.models import TINY_CONFIG, TINY_MODEL, CharTokenizer, write_random_model
from plexrl.models.tokenizer import EOS_TOKEN, VOCAB_SIZE, write_hf_tokenizer
from plexrl.tasks import TASKS

TEXTS = ["123+45=168", "rev:abc de=", " a  b ", "", "(1+2)*3/4-5:>,", "User: What is 4 + 5?\n\nAssistant: 9.\n\n"]


def test_special_ids_and_vocabulary_match_the_model_config() -> None:
    tok = CharTokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (
        TINY_CONFIG["pad_token_id"],
        TINY_CONFIG["bos_token_id"],
        TINY_CONFIG["eos_token_id"],
    )
    assert tok.vocab_size == VOCAB_SIZE == TINY_CONFIG["vocab_size"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_inverts_encode(text: str) -> None:
    tok = CharTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_decode_spells_special_tokens_unless_told_to_skip_them() -> None:
    tok = CharTokenizer()
    ids = [*tok.encode("12"), tok.eos_token_id, *tok.encode("3", add_special_tokens=False), tok.pad_token_id]
    assert tok.decode(ids) == f"<bos>12{EOS_TOKEN}3<pad>"
    assert tok.decode(ids, skip_special_tokens=True) == "123"


def test_every_id_decodes_and_unused_ones_are_visible() -> None:
    tok = CharTokenizer()
    assert tok.decode([VOCAB_SIZE - 1]) == f"<unused{VOCAB_SIZE - 1}>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([VOCAB_SIZE])


def test_an_unknown_character_is_named_in_the_error() -> None:
    with pytest.raises(ValueError, match="'B'"):
        CharTokenizer().encode("12B")


def _hf_texts() -> list[str]:
    problems = [p for task in TASKS.values() for p in task.sample(20, np.random.default_rng(0))]
    return [*TEXTS, *(p.prompt + p.answer for p in problems)]


def _assert_hf_matches(model_dir: Path | str) -> None:
    from transformers import AutoTokenizer

    tok = CharTokenizer()
    hf = AutoTokenizer.from_pretrained(model_dir)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    assert len(hf) == tok.vocab_size
    for text in _hf_texts():
        ids = tok.encode(text)
        assert hf(text)["input_ids"] == ids
        assert hf.decode(ids, skip_special_tokens=True) == text
        with_eos = [*ids, tok.eos_token_id]
        for skip in (False, True):  # what a sampled completion decodes to, either way
            assert hf.decode(with_eos, skip_special_tokens=skip) == tok.decode(with_eos, skip_special_tokens=skip)
    assert hf.decode([*tok.encode("42"), tok.eos_token_id, VOCAB_SIZE - 1], skip_special_tokens=True) == (
        f"42<unused{VOCAB_SIZE - 1}>"
    )


def test_written_hf_tokenizer_encodes_like_char_tokenizer(tmp_path: Path) -> None:
    _assert_hf_matches(write_hf_tokenizer(tmp_path))


def test_written_hf_tokenizer_encodes_like_char_tokenizer_beside_a_qwen2_model(tmp_path: Path) -> None:
    # transformers loads a qwen2 directory's tokenizer as Qwen2Tokenizer, with its own byte-level pipeline
    write_random_model(tmp_path)
    _assert_hf_matches(write_hf_tokenizer(tmp_path))


def test_the_shipped_model_tokenizer_encodes_like_char_tokenizer() -> None:
    _assert_hf_matches(TINY_MODEL)
