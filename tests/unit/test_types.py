"""Bad sampling parameters and badly shaped batches get typed errors that say what to fix."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import numpy as np
import pytest

from plexrl.errors import BatchShapeError, InvalidSamplingParamsError
from plexrl.types import Batch, Ragged, SamplingParams


@pytest.mark.parametrize(
    ("params", "complaint"),
    [
        (SamplingParams(n=0), "n=0"),
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=-1.0), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_k=-3), "top_k"),
        (SamplingParams(max_tokens=4, min_tokens=5), r"min_tokens=5 must be in 0\.\.max_tokens \(4\)"),
        (SamplingParams(min_tokens=-1), "min_tokens=-1"),
    ],
)
def test_invalid_sampling_params_are_named(params: SamplingParams, complaint: str) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=complaint):
        params.validate()


def test_default_sampling_params_are_valid() -> None:
    SamplingParams().validate()


@pytest.mark.parametrize("min_tokens", [0, 1, 4])
def test_min_tokens_up_to_max_tokens_is_valid(min_tokens: int) -> None:
    SamplingParams(max_tokens=4, min_tokens=min_tokens).validate()  # 4: every row exactly 4 tokens


def test_sampling_params_encoded_before_min_tokens_decode_with_min_tokens_0() -> None:
    """Wire evolution: a message from a peer that predates ``min_tokens`` still decodes."""

    class OldSamplingParams(msgspec.Struct, frozen=True):
        n: int = 1
        max_tokens: int = 16
        temperature: float = 1.0
        top_p: float = 1.0
        top_k: int = 0
        stop_token_ids: tuple[int, ...] = ()
        seed: int | None = None

    old = msgspec.msgpack.encode(OldSamplingParams(n=2, max_tokens=8, seed=3))
    assert msgspec.msgpack.decode(old, type=SamplingParams) == SamplingParams(n=2, max_tokens=8, seed=3, min_tokens=0)


def _ok() -> dict:
    return dict(
        tokens=Ragged.from_rows([[1, 5, 6], [1, 7]], "int32"),
        prompt_lens_B=np.array([1, 1], np.int32),
        sampler_logprobs=Ragged.from_rows([[-0.5, -0.2], [-1.0]], "float32"),
        advantages_B=np.array([1.0, -1.0], np.float32),
    )


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ({"prompt_lens_B": np.array([1], np.int32)}, "prompt_lens_B"),
        ({"prompt_lens_B": np.array([3, 1], np.int32)}, "completion token"),
        ({"sampler_logprobs": Ragged.from_rows([[-0.5], [-1.0]], "float32")}, "one value per completion token"),
        ({"advantages_B": np.array([1.0, 2.0, 3.0], np.float32)}, "advantages_B"),
        ({"advantages_B": np.array([np.nan, 1.0], np.float32)}, "NaN"),
        ({"advantages_B": None}, "needs sampler_logprobs and advantages_B"),
        ({"tokens": Ragged(values=np.array([1, 2], np.int32), offsets=np.array([0, 3, 2]))}, "offsets"),
    ],
)
def test_badly_shaped_batches_are_rejected(change: dict, complaint: str) -> None:
    with pytest.raises(BatchShapeError, match=complaint):
        Batch(**{**_ok(), **change}).validate("grpo")


def test_cross_entropy_needs_no_advantages_and_unknown_losses_are_named() -> None:
    Batch(tokens=_ok()["tokens"], prompt_lens_B=_ok()["prompt_lens_B"]).validate("cross_entropy")
    with pytest.raises(BatchShapeError, match="unknown loss 'ppo2'"):
        Batch(**_ok()).validate("ppo2")


def test_importing_plexrl_loads_no_heavy_framework() -> None:
    code = "import sys, plexrl; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'vllm', 'peft')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
