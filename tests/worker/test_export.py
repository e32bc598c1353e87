"""Exports for other tools: a trained job's PEFT adapter and merged model, loaded by peft and
transformers, give the job's own logprobs and greedy tokens (and differ from the base model's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_engine import PROMPTS, full_spec, generate, lora_spec, run, train  # the engine tests' helpers

from plexrl.errors import CallFailedError, InvalidRequestError
from plexrl.protocol.calls import Load, Logprobs, LogprobsResult, Open, Save, Saved
from plexrl.types import Ragged
from plexrl.worker.engine import Engine
from plexrl.worker.trainer import checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
ROWS = [[1, 5, 6, 7, 8, 9, 10], [1, 9, 10, 11, 12, 3, 4]]


def model_logprobs(model: Any) -> list[np.ndarray]:
    """Each row's next-token logprobs under a transformers model, as a Logprobs call gives them."""
    out = []
    with torch.no_grad():
        for row in ROWS:
            logits = model(input_ids=torch.tensor([row])).logits[0, :-1]
            lps = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(row[1:])[:, None])[:, 0]
            out.append(lps.numpy())
    return out


def greedy(model: Any, max_tokens: int) -> list[list[int]]:
    with torch.no_grad():
        return [
            model.generate(
                input_ids=torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=2, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in PROMPTS
        ]


def job_tokens(engine: Engine, job: str, max_tokens: int) -> list[list[int]]:
    out = generate(engine, job, max_tokens=max_tokens, temperature=0.0)
    return [t.tolist() for t in out.tokens]


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_exports_load_in_peft_and_transformers_and_match_the_job(tiny_model: Path, tmp_path: Path, kind: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine = Engine()
    engine.execute("a", Open(lora_spec(tiny_model) if kind == "lora" else full_spec(tiny_model)))
    train(engine, "a", steps=3)  # and sync: generate samples with the trained weights
    job = [lp for lp in run(engine, "a", Logprobs(Ragged.from_rows(ROWS, "int32")), LogprobsResult).logprobs]
    base = model_logprobs(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval())
    assert max(float(np.abs(j - b).max()) for j, b in zip(job, base, strict=True)) > 1e-3  # training moved them

    formats = ["peft", "hf"] if kind == "lora" else ["hf"]
    for fmt in formats:
        saved = run(engine, "a", Save(str(tmp_path / fmt), format=fmt), Saved)
        assert saved.step == 3 and saved.weight_version == 1
        if fmt == "peft":
            assert json.loads((tmp_path / fmt / "adapter_config.json").read_text())["r"] == 4
            base_model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
            model = PeftModel.from_pretrained(base_model, str(tmp_path / fmt)).eval()
        else:
            model = AutoModelForCausalLM.from_pretrained(tmp_path / fmt, dtype=torch.float32).eval()
            assert (tmp_path / fmt / "tokenizer_config.json").is_file() or not (
                tiny_model / "tokenizer_config.json"
            ).exists()
        for mine, theirs in zip(job, model_logprobs(model), strict=True):
            np.testing.assert_allclose(theirs, mine, rtol=0, atol=1e-4, err_msg=fmt)
        assert greedy(model, 6) == job_tokens(engine, "a", 6), fmt
        # An export is for other tools: load() refuses it, saying so, and the job is unchanged.
        with pytest.raises(CallFailedError, match=f"a {fmt} export for other tools"):
            engine.execute("a", Load(str(tmp_path / fmt)))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(formats)  # no temporary directories left


def test_a_full_job_has_no_adapter_to_export_and_bad_formats_are_named(tiny_model: Path, tmp_path: Path) -> None:
    engine = Engine()
    engine.execute("f", Open(full_spec(tiny_model)))
    with pytest.raises(InvalidRequestError, match="no adapter to export: use format='hf'"):
        engine.execute("f", Save(str(tmp_path / "x"), format="peft"))
    with pytest.raises(InvalidRequestError, match="save format 'onnx'"):
        engine.execute("f", Save(str(tmp_path / "y"), format="onnx"))
    assert list(tmp_path.iterdir()) == []  # nothing half-written
    (tmp_path / "mine").mkdir()
    with pytest.raises(InvalidRequestError, match="is not a plexrl checkpoint"):
        engine.execute("f", Save(str(tmp_path / "mine"), format="hf"))  # another directory is never replaced
    assert not (tmp_path / "mine" / checkpoint.MANIFEST).exists()
