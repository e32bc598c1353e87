"""The built-in losses as pure functions on tensors: no model, no job, unit-testable by hand.

Every loss is a *sum* over completion tokens (``mask_B_T``), returned with the token count.
The job divides the accumulated gradient by the accumulated token count at ``optim_step``, so
the step always follows the token-level mean over everything accumulated since the last step,
however the tokens were split across ``forward_backward`` calls.

Names follow the papers: ``ratio`` is the per-token importance ratio pi_theta / pi_old,
``A`` the per-sample advantage, ``k3`` Schulman's low-variance KL estimator.

``grpo``'s pi_old is the trainer's own logprob under the weights that sampled a row, where the
trainer still has them (as verl recomputes ``old_log_prob``): a sampler and a trainer differ in
kernels and precision (bf16), so their logprobs of the same weights differ, and a ratio against
the sampler's would clip on that noise. The mismatch is corrected by truncated importance
sampling (TIS): each token weighs ``min(pi_old / pi_sampler, is_cap)``, and ``logp_gap_mean`` /
``logp_gap_max`` report ``|log pi_old - log pi_sampler|``.

``decoupled_ppo`` is AReaL's loss for stale samples (Fu et al. 2025, eq. 5): the PPO clip is
taken against the proximal policy pi_prox (the trainer's weights before this update, here the
detached current logprobs), and each token is weighted by pi_prox / pi_sampler, truncated at
``is_cap``, which corrects for the samples having come from older weights.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from plexrl.errors import InvalidRequestError
from plexrl.types import LOSSES, LossConfig


class LossOutput(NamedTuple):
    loss_sum: Tensor  # scalar: sum of the per-token loss over completion tokens (differentiable)
    num_tokens: int  # completion tokens the sum covers
    metrics: dict[str, float]  # token means, for logging

    @property
    def loss_mean(self) -> float:
        return float(self.loss_sum.detach()) / max(self.num_tokens, 1)


def token_logprobs(logits_B_T_V: Tensor, targets_B_T: Tensor, temperature: float = 1.0) -> Tensor:
    """``log_softmax(logits / temperature)`` at each target token, in float32 (any leading shape;
    no log-softmax over the vocabulary is kept, only its normaliser)."""
    logits_B_T_V = logits_B_T_V.float() / temperature
    target_B_T = logits_B_T_V.gather(-1, targets_B_T.long().unsqueeze(-1)).squeeze(-1)
    return target_B_T - torch.logsumexp(logits_B_T_V, dim=-1)


def kl_k3(logp_B_T: Tensor, ref_logp_B_T: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || reference): ``exp(d) - d - 1`` with ``d = ref - logp``."""
    d_B_T = ref_logp_B_T - logp_B_T
    return torch.exp(d_B_T) - d_B_T - 1.0


def check_loss_config(config: LossConfig) -> None:
    """Raise ``InvalidRequestError`` (saying what to fix) unless every knob is in range."""
    problems = []
    if not 0.0 <= config.clip_low < 1.0:
        problems.append(f"clip_low={config.clip_low} must be in [0, 1)")
    if not config.clip_high >= 0.0:
        problems.append(f"clip_high={config.clip_high} must be >= 0")
    if not config.kl_coef >= 0.0:
        problems.append(f"kl_coef={config.kl_coef} must be >= 0 (0 disables the KL term)")
    if not config.temperature > 0.0:
        problems.append(f"temperature={config.temperature} must be > 0")
    if not config.is_cap >= 1.0:
        problems.append(f"is_cap={config.is_cap} must be >= 1 (the importance weight's truncation)")
    if problems:
        raise InvalidRequestError("invalid LossConfig: " + "; ".join(problems))


def compute_loss(
    loss: str,
    logp_B_T: Tensor,
    mask_B_T: Tensor,
    config: LossConfig,
    sampler_logp_B_T: Tensor | None = None,
    advantages_B: Tensor | None = None,
    ref_logp_B_T: Tensor | None = None,
    weights_B_T: Tensor | None = None,
    recomputed_B: Tensor | None = None,
) -> LossOutput:
    """The summed loss named ``loss`` over the tokens where ``mask_B_T`` is true.

    ``logp_B_T`` are the trainer's logprobs of the target tokens (differentiable);
    ``sampler_logp_B_T`` the sampler's, aligned with them; ``ref_logp_B_T`` the reference
    model's, needed only for ``grpo`` with ``kl_coef > 0``. ``advantages_B`` are per row, or per
    token (``[B, T]``); ``weights_B_T`` multiply each token's loss.

    ``recomputed_B`` (``grpo``): the rows whose ``logp_B_T`` are taken under the very weights that
    sampled them. Their PPO ratio is against the trainer's own logprobs (detached: exactly 1 at
    the first update), and the sampler/trainer mismatch is corrected by the truncated importance
    weight ``min(pi_old / pi_sampler, is_cap)`` (TIS); the other rows' ratio is against the
    sampler's logprobs. ``decoupled_ppo`` treats every row so (pi_old is then AReaL's proximal policy).
    """
    if loss not in LOSSES:
        raise InvalidRequestError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")
    mask_B_T = mask_B_T.bool()
    num_tokens = int(mask_B_T.sum())
    metrics = {"logp_mean": _masked_mean(logp_B_T.detach(), mask_B_T)}

    if loss == "cross_entropy":
        per_token_B_T = -logp_B_T
    else:
        if sampler_logp_B_T is None or advantages_B is None:
            raise InvalidRequestError(f"loss {loss!r} needs sampler logprobs and advantages")
        A_B_T = advantages_B.to(logp_B_T.dtype)
        A_B_T = A_B_T.unsqueeze(-1).expand_as(logp_B_T) if A_B_T.dim() == 1 else A_B_T
        if loss == "importance_sampling":
            ratio_B_T = torch.exp(logp_B_T - sampler_logp_B_T)
            metrics["ratio_mean"] = _masked_mean(ratio_B_T.detach(), mask_B_T)
            per_token_B_T = -ratio_B_T * A_B_T
        else:
            if loss == "decoupled_ppo" or recomputed_B is None:
                recomputed_B = torch.full(logp_B_T.shape[:1], loss == "decoupled_ppo", device=logp_B_T.device)
            own_B_T = recomputed_B.bool().unsqueeze(-1).expand_as(logp_B_T)
            old_logp_B_T = torch.where(own_B_T, logp_B_T.detach(), sampler_logp_B_T)
            ratio_B_T = torch.exp(logp_B_T - old_logp_B_T)
            behave_B_T = torch.exp(old_logp_B_T - sampler_logp_B_T)  # 1 where old is the sampler's
            weight_B_T = torch.clamp(behave_B_T, max=config.is_cap)
            own_mask_B_T = own_B_T & mask_B_T
            gap_B_T = (old_logp_B_T - sampler_logp_B_T).abs()
            metrics["ratio_mean"] = _masked_mean(ratio_B_T.detach(), mask_B_T)
            metrics["recomputed_frac"] = _masked_mean(own_B_T.float(), mask_B_T)
            metrics["logp_gap_mean"] = _masked_mean(gap_B_T, own_mask_B_T)
            metrics["logp_gap_max"] = float(gap_B_T[own_mask_B_T].max()) if own_mask_B_T.any() else 0.0
            metrics["is_weight_mean"] = _masked_mean(weight_B_T, mask_B_T)
            metrics["is_truncated_frac"] = _masked_mean((behave_B_T > config.is_cap).float(), mask_B_T)
            unclipped_B_T = ratio_B_T * A_B_T
            clipped_B_T = torch.clamp(ratio_B_T, 1.0 - config.clip_low, 1.0 + config.clip_high) * A_B_T
            per_token_B_T = -torch.minimum(unclipped_B_T, clipped_B_T) * weight_B_T
            # "clipped" = the clipped term won the min, so the token contributes no gradient.
            metrics["clip_frac"] = _masked_mean((clipped_B_T < unclipped_B_T).float(), mask_B_T)
            if config.kl_coef > 0.0:
                if ref_logp_B_T is None:
                    raise InvalidRequestError(f"{loss} with kl_coef > 0 needs reference logprobs")
                k3_B_T = kl_k3(logp_B_T, ref_logp_B_T)
                per_token_B_T = per_token_B_T + config.kl_coef * k3_B_T
                metrics["kl"] = _masked_mean(k3_B_T.detach(), mask_B_T)

    if weights_B_T is not None:
        per_token_B_T = per_token_B_T * weights_B_T.to(per_token_B_T.dtype)
    # where() rather than multiply: a masked-out inf/nan (e.g. padding) must not poison the sum.
    loss_sum = torch.where(mask_B_T, per_token_B_T, torch.zeros_like(per_token_B_T)).sum()
    return LossOutput(loss_sum=loss_sum, num_tokens=num_tokens, metrics=metrics)


def combined(outs: list[LossOutput], idle_tokens: int = 0) -> LossOutput:
    """One ``LossOutput`` of several micro-batches' (their sums added, their token means weighted
    by tokens, the gap's by the tokens it covers, maxima maxed), counting ``idle_tokens`` more
    tokens whose loss is zero (left out of the metrics' means)."""
    if not outs:
        return LossOutput(torch.zeros(()), idle_tokens, {})
    num_tokens = sum(o.num_tokens for o in outs)
    metrics = dict(outs[0].metrics)
    if len(outs) > 1:
        for k in metrics:
            if k.endswith("_max"):
                metrics[k] = max(o.metrics[k] for o in outs)
                continue
            by = [o.num_tokens * (o.metrics["recomputed_frac"] if k == "logp_gap_mean" else 1.0) for o in outs]
            metrics[k] = sum(o.metrics[k] * w for o, w in zip(outs, by, strict=True)) / max(sum(by), 1e-12)
    loss_sum = sum((o.loss_sum for o in outs[1:]), outs[0].loss_sum)
    return LossOutput(loss_sum, num_tokens + idle_tokens, metrics)


def _masked_mean(x_B_T: Tensor, mask_B_T: Tensor) -> float:
    n = int(mask_B_T.sum())
    return float(torch.where(mask_B_T, x_B_T, torch.zeros_like(x_B_T)).sum()) / max(n, 1)
