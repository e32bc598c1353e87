"""The built-in losses on small hand-computed tensors (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from plexrl.errors import InvalidRequestError
from plexrl.types import LossConfig
from plexrl.worker.trainer.losses import check_loss_config, combined, compute_loss, kl_k3, token_logprobs

LN2 = math.log(2.0)


def logps(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


def test_token_logprobs_is_log_softmax_at_the_target() -> None:
    logits_B_T_V = torch.tensor([[[0.0, 0.0], [0.0, LN2]]])
    targets_B_T = torch.tensor([[0, 1]])
    assert token_logprobs(logits_B_T_V, targets_B_T).tolist()[0] == pytest.approx([-LN2, math.log(2 / 3)])


def test_token_logprobs_divides_logits_by_temperature() -> None:
    logits_B_T_V = torch.tensor([[[0.0, 2 * LN2]]])
    # T = 2 turns the logits into [0, ln 2]: p(token 1) = 2/3.
    assert token_logprobs(logits_B_T_V, torch.tensor([[1]]), temperature=2.0).item() == pytest.approx(math.log(2 / 3))


def test_cross_entropy_is_the_token_mean_of_minus_logp_over_completion_tokens() -> None:
    out = compute_loss("cross_entropy", logps(-9.0, -1.0, -3.0), torch.tensor([[0, 1, 1]]), LossConfig())
    assert out.num_tokens == 2
    assert out.loss_sum.item() == pytest.approx(4.0)
    assert out.loss_mean == pytest.approx(2.0)  # the prompt token's -9 is masked out


def test_loss_is_a_token_level_mean_not_a_mean_of_sample_means() -> None:
    logp_B_T = torch.tensor([[-1.0, 0.0, 0.0], [-4.0, -4.0, -4.0]])
    mask_B_T = torch.tensor([[1, 0, 0], [1, 1, 1]])
    out = compute_loss("cross_entropy", logp_B_T, mask_B_T, LossConfig())
    assert out.loss_mean == pytest.approx(13.0 / 4)  # sample means would give (1 + 4) / 2


def test_importance_sampling_weights_advantages_by_the_ratio() -> None:
    logp = logps(math.log(0.5), math.log(0.3))
    sampler = logps(math.log(0.25), math.log(0.3))  # ratios 2 and 1
    out = compute_loss("importance_sampling", logp, torch.tensor([[1, 1]]), LossConfig(), sampler, torch.tensor([1.5]))
    assert out.loss_mean == pytest.approx(-(2 * 1.5 + 1 * 1.5) / 2)
    assert out.metrics["ratio_mean"] == pytest.approx(1.5)


def grpo(ratio: float, advantage: float, **config: float) -> tuple[float, float]:
    """(loss, d loss / d logp) of one grpo token with the given ratio and advantage."""
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    out = compute_loss(
        "grpo", logp, torch.tensor([[1]]), LossConfig(**config), torch.zeros(1, 1), torch.tensor([advantage])
    )
    out.loss_sum.backward()
    assert logp.grad is not None
    return out.loss_mean, logp.grad.item()


def test_grpo_clips_the_ratio_from_above_for_positive_advantages() -> None:
    loss, grad = grpo(1.5, 2.0, clip_high=0.2)
    assert loss == pytest.approx(-1.2 * 2.0)
    assert grad == 0.0  # clipped: no incentive to push the ratio further


def test_grpo_clips_the_ratio_from_below_for_negative_advantages() -> None:
    loss, grad = grpo(0.5, -2.0, clip_low=0.2)
    assert loss == pytest.approx(-(0.8 * -2.0))
    assert grad == 0.0


def test_grpo_does_not_clip_where_clipping_would_raise_the_objective() -> None:
    # ratio above 1 + clip_high but negative advantage: the unclipped (smaller) term is kept.
    loss, grad = grpo(1.5, -2.0, clip_high=0.2)
    assert loss == pytest.approx(-(1.5 * -2.0))
    assert grad == pytest.approx(-(1.5 * -2.0))  # d(-ratio * A)/d logp = -ratio * A


def test_grpo_inside_the_clip_range_is_the_importance_sampling_loss() -> None:
    loss, grad = grpo(1.1, 3.0, clip_low=0.2, clip_high=0.2)
    assert loss == pytest.approx(-1.1 * 3.0)
    assert grad == pytest.approx(-1.1 * 3.0)


def test_grpo_clip_frac_counts_tokens_whose_clipped_term_won() -> None:
    ratio_B_T = torch.tensor([[1.5, 0.5], [1.5, 0.5]])
    out = compute_loss(
        "grpo", torch.log(ratio_B_T), torch.ones(2, 2), LossConfig(), torch.zeros(2, 2), torch.tensor([1.0, -1.0])
    )
    # Clipped: 1.5 with A > 0 and 0.5 with A < 0; the other two keep their unclipped term.
    assert out.metrics["clip_frac"] == pytest.approx(0.5)


def test_k3_matches_its_formula() -> None:
    # d = ref - logp = ln 0.5: k3 = 0.5 - ln 0.5 - 1.
    value = kl_k3(logps(math.log(0.5)), logps(math.log(0.25))).item()
    assert value == pytest.approx(0.5 + LN2 - 1.0)
    assert kl_k3(logps(-1.3), logps(-1.3)).item() == 0.0


def test_grpo_adds_kl_coef_times_the_mean_k3() -> None:
    logp = logps(math.log(0.5), math.log(0.5))
    ref = logps(math.log(0.25), math.log(0.5))
    out = compute_loss("grpo", logp, torch.ones(1, 2), LossConfig(kl_coef=0.1), logp.clone(), torch.tensor([0.0]), ref)
    k3 = 0.5 + LN2 - 1.0
    assert out.loss_mean == pytest.approx(0.1 * k3 / 2)
    assert out.metrics["kl"] == pytest.approx(k3 / 2)


def test_grpo_with_kl_needs_reference_logprobs() -> None:
    with pytest.raises(InvalidRequestError, match="reference"):
        compute_loss("grpo", logps(-1.0), torch.ones(1, 1), LossConfig(kl_coef=0.1), logps(-1.0), torch.ones(1))


def test_masked_out_tokens_get_no_gradient() -> None:
    logp = logps(-1.0, -2.0).requires_grad_(True)
    compute_loss("cross_entropy", logp, torch.tensor([[0, 1]]), LossConfig()).loss_sum.backward()
    assert logp.grad is not None and logp.grad.tolist() == [[0.0, -1.0]]


@pytest.mark.parametrize(
    "config", [LossConfig(clip_low=1.0), LossConfig(clip_high=-0.1), LossConfig(kl_coef=-1), LossConfig(temperature=0)]
)
def test_out_of_range_loss_configs_are_rejected(config: LossConfig) -> None:
    with pytest.raises(InvalidRequestError, match="LossConfig"):
        check_loss_config(config)


def test_decoupled_ppo_weights_each_token_by_its_truncated_behaviour_importance_weight() -> None:
    """pi_prox = the trainer now (ratio 1 before the update); w = pi_prox / pi_sampler: 2 for the
    first token, 10 for the second, truncated to is_cap = 5."""
    logp = torch.tensor([[math.log(0.5), math.log(0.6)]], requires_grad=True)
    sampler = logps(math.log(0.25), math.log(0.06))
    out = compute_loss(
        "decoupled_ppo", logp, torch.tensor([[1, 1]]), LossConfig(is_cap=5.0), sampler, torch.tensor([1.5])
    )
    assert out.loss_sum.item() == pytest.approx(-(2 + 5) * 1.5)
    assert out.metrics["is_weight_mean"] == pytest.approx(3.5)
    assert out.metrics["is_truncated_frac"] == pytest.approx(0.5)
    assert out.metrics["ratio_mean"] == pytest.approx(1.0)
    out.loss_sum.backward()
    assert logp.grad is not None
    assert logp.grad.tolist()[0] == pytest.approx([-2 * 1.5, -5 * 1.5])  # d(-w * A * ratio) / d logp


def test_decoupled_ppo_on_fresh_samples_is_grpo() -> None:
    logp = torch.tensor([[math.log(0.5), math.log(0.2)]], requires_grad=True)
    mask, adv = torch.tensor([[1, 1]]), torch.tensor([-0.7])
    decoupled = compute_loss("decoupled_ppo", logp, mask, LossConfig(), logp.detach(), adv)
    plain = compute_loss("grpo", logp, mask, LossConfig(), logp.detach(), adv)
    assert decoupled.loss_sum.item() == pytest.approx(plain.loss_sum.item())
    assert decoupled.metrics["is_weight_mean"] == pytest.approx(1.0)


def test_is_cap_below_one_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match=r"is_cap=0\.5 must be >= 1"):
        check_loss_config(LossConfig(is_cap=0.5))


def test_grpo_on_recomputed_rows_takes_the_ratio_against_the_trainer_and_weighs_by_tis() -> None:
    """Row 0 was sampled by the weights the trainer holds: its ratio is against the trainer's own
    logprobs (exactly 1 before the update) and each token weighs min(pi_old / pi_sampler, cap):
    2 and 10 -> 5. Row 1 was not: its ratio is against the sampler's, weight 1."""
    logp = torch.tensor([[math.log(0.5), math.log(0.6)], [math.log(0.3), math.log(0.3)]], requires_grad=True)
    sampler = torch.tensor([[math.log(0.25), math.log(0.06)], [math.log(0.3), math.log(0.3)]])
    out = compute_loss(
        "grpo",
        logp,
        torch.ones(2, 2, dtype=torch.bool),
        LossConfig(is_cap=5.0),
        sampler,
        torch.tensor([1.5, -1.0]),
        recomputed_B=torch.tensor([True, False]),
    )
    assert out.loss_sum.item() == pytest.approx(-(2 + 5) * 1.5 + 2 * 1.0)
    assert out.metrics["ratio_mean"] == 1.0  # exactly: exp(logp - logp) and exp(sampler - sampler)
    assert out.metrics["recomputed_frac"] == pytest.approx(0.5)
    # The gap covers the recomputed row's tokens only: |ln 2| and |ln 10|.
    assert out.metrics["logp_gap_mean"] == pytest.approx((LN2 + math.log(10)) / 2)
    assert out.metrics["logp_gap_max"] == pytest.approx(math.log(10))
    out.loss_sum.backward()
    assert logp.grad is not None
    assert logp.grad.tolist() == [pytest.approx([-2 * 1.5, -5 * 1.5]), pytest.approx([1.0, 1.0])]


def test_grpo_without_recomputed_rows_is_plain_ppo_against_the_sampler() -> None:
    logp = torch.tensor([[math.log(0.5), math.log(0.2)]], requires_grad=True)
    sampler = logps(math.log(0.25), math.log(0.4))
    mask, adv = torch.tensor([[1, 1]]), torch.tensor([1.0])
    out = compute_loss("grpo", logp, mask, LossConfig(clip_high=0.2), sampler, adv)
    assert out.loss_sum.item() == pytest.approx(-(1.2 + 0.5))  # ratio 2 clipped to 1.2; ratio 0.5
    assert out.metrics["is_weight_mean"] == 1.0
    assert out.metrics["recomputed_frac"] == 0.0


def test_combined_micro_batches_weigh_means_by_tokens_and_take_maxima() -> None:
    mask = torch.ones(1, 2, dtype=torch.bool)
    config, adv = LossConfig(), torch.tensor([1.0])
    first = compute_loss(
        "grpo", logps(-1.0, -1.0), mask, config, logps(-1.5, -1.0), adv, recomputed_B=torch.tensor([True])
    )
    second = compute_loss(
        "grpo", logps(-2.0), mask[:, :1], config, logps(-2.1), adv, recomputed_B=torch.tensor([False])
    )
    out = combined([first, second], idle_tokens=4)
    assert out.num_tokens == 2 + 1 + 4
    assert out.loss_sum.item() == pytest.approx(first.loss_sum.item() + second.loss_sum.item())
    assert out.metrics["logp_mean"] == pytest.approx((-1 - 1 - 2) / 3)
    assert out.metrics["recomputed_frac"] == pytest.approx(2 / 3)
    assert out.metrics["logp_gap_mean"] == pytest.approx(0.25)  # over the two recomputed tokens only
    assert out.metrics["logp_gap_max"] == pytest.approx(0.5)
