"""The trainer's bounded forward pieces against plain autograd on small tensors."""

from __future__ import annotations

import pytest
import torch

from plexrl.worker.trainer.forward import HeadLogprobs
from plexrl.worker.trainer.losses import token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_logprobs_and_their_gradients_are_autograds_through_the_full_logits(temperature: float) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.tensor([0, 3, 10, 3, 7, 1])
    upstream = torch.randn(6, dtype=torch.float64, generator=gen)

    fused = HeadLogprobs.apply(hidden, weight, targets, temperature, torch.float64)
    (fused * upstream).sum().backward()
    got = fused.detach(), hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    plain = token_logprobs(hidden @ weight.t(), targets, temperature)  # float32, as the fused softmax
    (plain * upstream).sum().backward()
    torch.testing.assert_close(got, (plain.detach(), hidden.grad, weight.grad), atol=1e-5, rtol=1e-5)


def test_head_logprobs_in_bf16_stay_within_bf16_rounding_of_float32() -> None:
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 64, generator=gen) * 0.5
    weight = torch.randn(300, 64, generator=gen) * 0.5
    targets = torch.randint(0, 300, (5,), generator=gen)
    exact = HeadLogprobs.apply(hidden, weight, targets, 1.0, torch.float32)
    low = HeadLogprobs.apply(hidden, weight, targets, 1.0, torch.bfloat16)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, exact, atol=0.1, rtol=0.02)
    assert not torch.equal(low, exact)
