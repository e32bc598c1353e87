"""The shipped ``tiny-arith`` model: it loads with transformers, matches its documented config, and
is partially competent (some held-out ``add`` problems right, some wrong), so RL has headroom."""

from pathlib import Path
from typing import Any

import pytest
import torch

from plexrl.models import TINY_MODEL, CharTokenizer
from plexrl.models.pretrain import ARITH_CONFIG
from plexrl.tasks import get_task


@pytest.fixture(scope="module")
def model() -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32).eval()


def test_the_directory_holds_weights_tokenizer_and_card() -> None:
    names = {p.name for p in Path(TINY_MODEL).iterdir()}
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"}
    assert expected | {"tokenizer_config.json", "MODEL_CARD.md"} <= names
    assert (Path(TINY_MODEL) / "model.safetensors").stat().st_size <= 20_000_000


def test_the_config_is_the_documented_one(model: Any) -> None:
    assert type(model).__name__ == "Qwen2ForCausalLM"
    for key, value in ARITH_CONFIG.items():
        assert getattr(model.config, key) == value, key
    assert model.config.hidden_size // model.config.num_attention_heads in (32, 64)
    assert model.generation_config.eos_token_id == CharTokenizer.eos_token_id


def test_greedy_add_is_partially_right_on_held_out_problems(model: Any) -> None:
    task, tok = get_task("add"), CharTokenizer()
    problems = task.eval_set()[:50]
    scores = []
    with torch.no_grad():
        for p in problems:
            prompt = torch.tensor([tok.encode(p.prompt)])
            out = model.generate(prompt, do_sample=False, max_new_tokens=8, pad_token_id=tok.pad_token_id)
            scores.append(task.score(p, tok.decode(out[0, prompt.shape[1] :].tolist(), skip_special_tokens=True)))
    assert 0.0 < sum(scores) / len(scores) < 1.0
