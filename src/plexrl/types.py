"""Value types shared by the user API and the wire: sampling, adapters, optimizers, batches.

Everything here is a msgspec Struct holding numpy arrays, so the same object a user builds is
what travels to the worker (arrays go as zero-copy frames, see ``plexrl.protocol.codec``).
Shape suffixes follow tinker-cookbook: ``_B`` per sample, ``_N`` flat over tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import msgspec
import numpy as np

from plexrl.errors import BatchShapeError, InvalidSamplingParamsError

LOSSES = ("grpo", "importance_sampling", "cross_entropy", "decoupled_ppo")
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class SamplingParams(msgspec.Struct, frozen=True):
    """How to sample: ``n`` completions per prompt, ``min_tokens`` to ``max_tokens`` new tokens each."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    stop_token_ids: tuple[int, ...] = ()  # the model's EOS always stops too
    # Text that ends a completion, matched on the decoded text by the sampler (so it may end inside
    # a token or span several); the token completing it is the last one kept. Needs tokenizer
    # files in the model directory.
    stop: tuple[str, ...] = ()
    seed: int | None = None  # None = derived from the job's seed and its call count
    # EOS and stop tokens are masked until this many tokens are out (min_tokens == max_tokens: every
    # row runs to full length). The hf sampler reports logprobs of the unmasked distribution; vLLM
    # renormalises over the allowed tokens, as it does for top-k / top-p.
    min_tokens: int = 0

    def validate(self) -> None:
        problems = []
        if not 1 <= self.n <= 1024:
            problems.append(f"n={self.n} must be in 1..1024")
        if not 1 <= self.max_tokens <= 1 << 16:
            problems.append(f"max_tokens={self.max_tokens} must be in 1..65536")
        if not 0 <= self.min_tokens <= self.max_tokens:
            problems.append(f"min_tokens={self.min_tokens} must be in 0..max_tokens ({self.max_tokens})")
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            problems.append(f"temperature={self.temperature} must be a finite number >= 0")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if any(t < 0 for t in self.stop_token_ids):
            problems.append("stop_token_ids must be non-negative token ids")
        if len(self.stop) > 16 or not all(isinstance(s, str) and s for s in self.stop):
            problems.append(f"stop={self.stop!r} must be at most 16 non-empty strings")
        if problems:
            raise InvalidSamplingParamsError("invalid SamplingParams: " + "; ".join(problems))


class LoRA(msgspec.Struct, frozen=True):
    """Train a LoRA adapter on the shared frozen base model."""

    rank: int = 8
    alpha: float | None = None  # None = 2 * rank
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_LORA_TARGETS


class AdamW(msgspec.Struct, frozen=True):
    """AdamW settings for a job's own optimizer."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0  # max global grad norm; None = no clipping


class LossConfig(msgspec.Struct, frozen=True):
    """Knobs of the built-in losses (``grpo`` uses all of them)."""

    clip_low: float = 0.2  # PPO ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    kl_coef: float = 0.0  # > 0 adds beta * KL(policy || base model), k3 estimator
    temperature: float = 1.0  # the sampling temperature the logprobs were taken at
    # grpo and decoupled_ppo: the importance weight pi_old / pi_sampler (TIS: the sampler/trainer
    # mismatch, or decoupled_ppo's staleness) is truncated at this
    is_cap: float = 5.0


class Ragged(msgspec.Struct, frozen=True):
    """A list of 1-D arrays stored flat: row ``i`` is ``values[offsets[i]:offsets[i + 1]]``."""

    values: np.ndarray
    offsets: np.ndarray  # int64, len(rows) + 1, starts at 0

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[int] | Sequence[float] | np.ndarray], dtype: str) -> Ragged:
        arrays = [np.asarray(r, dtype=dtype).reshape(-1) for r in rows]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        values = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
        return cls(values=values.astype(dtype, copy=False), offsets=offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def check(self, what: str) -> None:
        """Raise ``BatchShapeError`` unless the offsets describe ``values`` exactly."""
        o = self.offsets
        if self.values.ndim != 1 or o.ndim != 1 or len(o) < 1:
            raise BatchShapeError(f"{what}: values and offsets must be 1-D, offsets non-empty")
        if o[0] != 0 or o[-1] != len(self.values) or np.any(np.diff(o) < 0):
            raise BatchShapeError(
                f"{what}: offsets must start at 0, never decrease and end at len(values)={len(self.values)}"
            )


class Sample(msgspec.Struct, frozen=True):
    """One completion: its tokens, the sampler's logprob of each, and the weights that made it."""

    prompt_index: int
    tokens: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T]
    finish_reason: str  # "stop" (EOS or a stop token) or "length"
    weight_version: int


class Batch(msgspec.Struct, frozen=True):
    """A training batch: full sequences (prompt + completion); the loss covers completions only."""

    tokens: Ragged  # int32, prompt + completion per sample
    prompt_lens_B: np.ndarray  # int32 [B]
    sampler_logprobs: Ragged | None = None  # float32, one per completion token
    advantages_B: np.ndarray | None = None  # float32 [B]
    weight_versions_B: np.ndarray | None = None  # int64 [B]: the version that sampled each row (its oldest)
    # Multi-turn rows (``plexrl.trajectory_batch``): per completion token, 1 where the loss covers
    # it (sampled) and 0 where it does not (observations a tool returned); None = every token.
    loss_mask: Ragged | None = None  # int8
    token_versions: Ragged | None = None  # int64 per completion token: its weight version, -1 if not sampled
    # Per completion token (Tinker's datums, ``plexrl.gateway``): each token's loss is multiplied by
    # its weight (0: left out); each token's advantage is used instead of its row's ``advantages_B``.
    token_weights: Ragged | None = None  # float32
    token_advantages: Ragged | None = None  # float32

    @classmethod
    def from_samples(
        cls,
        prompts: Sequence[Sequence[int] | np.ndarray],
        samples: Sequence[Sample],
        advantages: Sequence[float] | np.ndarray | None = None,
    ) -> Batch:
        """Build a batch from generated samples; ``prompts`` are the prompts given to generate."""
        rows = [np.concatenate([np.asarray(prompts[s.prompt_index], np.int32), s.tokens]) for s in samples]
        return cls(
            tokens=Ragged.from_rows(rows, "int32"),
            prompt_lens_B=np.array([len(prompts[s.prompt_index]) for s in samples], np.int32),
            sampler_logprobs=Ragged.from_rows([s.logprobs for s in samples], "float32"),
            advantages_B=None if advantages is None else np.asarray(advantages, np.float32),
            weight_versions_B=np.array([s.weight_version for s in samples], np.int64),
        )

    def __len__(self) -> int:
        return len(self.tokens)

    def validate(self, loss: str) -> None:
        """Raise ``BatchShapeError`` (saying what to fix) unless the batch fits ``loss``."""
        if loss not in LOSSES:
            raise BatchShapeError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")
        self.tokens.check("tokens")
        n = len(self.tokens)
        if n == 0:
            raise BatchShapeError("empty batch: add at least one sample")
        lens = self.tokens.lengths()
        p = self.prompt_lens_B
        if p.shape != (n,):
            raise BatchShapeError(f"prompt_lens_B has shape {p.shape}, expected ({n},): one per sample")
        if np.any(p < 1) or np.any(p >= lens):
            raise BatchShapeError("each sample needs 1 <= prompt_len < len(tokens): at least one completion token")
        if loss != "cross_entropy" and (
            self.sampler_logprobs is None or (self.advantages_B is None and self.token_advantages is None)
        ):
            raise BatchShapeError(f"loss {loss!r} needs sampler_logprobs and advantages_B (or token_advantages)")
        if self.sampler_logprobs is not None:
            self.sampler_logprobs.check("sampler_logprobs")
            if len(self.sampler_logprobs) != n or np.any(self.sampler_logprobs.lengths() != lens - p):
                raise BatchShapeError("sampler_logprobs needs one value per completion token of each sample")
        for name in ("loss_mask", "token_versions", "token_weights", "token_advantages"):
            per_token: Ragged | None = getattr(self, name)
            if per_token is None:
                continue
            per_token.check(name)
            if len(per_token) != n or np.any(per_token.lengths() != lens - p):
                raise BatchShapeError(f"{name} needs one value per completion token of each sample")
            if name in ("token_weights", "token_advantages") and not np.all(np.isfinite(per_token.values)):
                raise BatchShapeError(f"{name} contains NaN or inf")
        if self.loss_mask is not None:
            if not np.all((self.loss_mask.values == 0) | (self.loss_mask.values == 1)):
                raise BatchShapeError("loss_mask holds 1 (in the loss) or 0 (not) per completion token")
            if np.any(np.add.reduceat(self.loss_mask.values.astype(np.int64), self.loss_mask.offsets[:-1]) == 0):
                raise BatchShapeError("every sample needs at least one completion token in the loss (loss_mask 1)")
        for name in ("advantages_B", "weight_versions_B"):
            arr = getattr(self, name)
            if arr is not None and arr.shape != (n,):
                raise BatchShapeError(f"{name} has shape {arr.shape}, expected ({n},): one per sample")
        if self.advantages_B is not None and not np.all(np.isfinite(self.advantages_B)):
            raise BatchShapeError("advantages_B contains NaN or inf")
