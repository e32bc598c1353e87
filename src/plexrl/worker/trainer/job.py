"""One job's state on a worker and the calls on it, the same for LoRA and full fine-tune jobs.

A job is a pair of weights (trainer and sampler: ``LoraWeights`` or ``FullWeights``), its own
AdamW over the trainer weights, and three counters: optimizer steps, the sampler's
``weight_version`` and generate calls (for per-call seeds).

Gradient accumulation: each ``forward_backward`` backpropagates the *sum* of its per-token losses
and adds its token count to ``pending_tokens``; ``optim_step`` divides the gradients by
``pending_tokens`` before clipping and stepping. So a step follows the token-level mean over all
tokens accumulated since the last step, and two half-batch calls step exactly like one call.

Memory: a ``forward_backward`` runs its rows in micro-batches (``forward.microbatches``: rows of
similar length together, at most a quarter of a padded row is padding, at most the worker's
``max_tokens_per_microbatch`` padded tokens each) with a backward per micro-batch, so what it
holds is set by the worker's budget, not by the size of the call; see ``forward.py`` for
precision, checkpointing and chunked logprobs.
"""

from __future__ import annotations

import io
import math
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import numpy as np
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from plexrl.errors import (
    BatchShapeError,
    CallFailedError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    StaleSamplesError,
)
from plexrl.names import EXPORT_FORMATS
from plexrl.protocol.calls import (
    Closed,
    ForwardBackward,
    ForwardBackwardResult,
    Generated,
    JobSpec,
    Loaded,
    LogprobsResult,
    Opened,
    OptimStepResult,
    Saved,
    Snapshot,
    Synced,
    SyncWeights,
    generate_seed,
)
from plexrl.types import AdamW, Batch, LossConfig, Ragged, SamplingParams
from plexrl.worker import export
from plexrl.worker.memory import planned_state_bytes
from plexrl.worker.models import BaseModel, require_tokenizer
from plexrl.worker.progress import Progress
from plexrl.worker.sampler import hf
from plexrl.worker.trainer import checkpoint
from plexrl.worker.trainer.forward import TrainerSettings, autocast, microbatches, set_checkpointing, target_logprobs
from plexrl.worker.trainer.losses import LossOutput, check_loss_config, combined, compute_loss
from plexrl.worker.trainer.rows import member_rows

if TYPE_CHECKING:
    from plexrl.worker.gang import Gang
    from plexrl.worker.sampler.vllm import VllmSampler


class Weights(Protocol):
    """What a job trains and samples with: ``LoraWeights`` or ``FullWeights``."""

    kind: str
    sharded: bool  # the trainer weights are sharded over a gang (FSDP2: each parameter a DTensor)
    trainer_params: dict[str, nn.Parameter]
    sampler_params: dict[str, nn.Parameter]  # same names and shapes as trainer_params; empty if vLLM samples
    total_params: int

    def trainer_model(self, train: bool) -> nn.Module: ...
    def sampler_model(self) -> nn.Module: ...
    def adapter_config(self) -> Any: ...  # the peft LoraConfig (LoRA jobs only)
    def close(self) -> None: ...


def check_spec(spec: JobSpec) -> None:
    """Raise ``InvalidRequestError`` unless the optimizer settings are usable."""
    check_adamw(spec.optimizer)
    if spec.max_staleness < 0:
        raise InvalidRequestError(f"max_staleness={spec.max_staleness} must be >= 0 (0 = strictly on-policy)")


def check_adamw(o: AdamW) -> None:
    problems = []
    if not (o.lr > 0 and math.isfinite(o.lr)):
        problems.append(f"lr={o.lr} must be a finite number > 0")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        problems.append(f"betas={o.betas} must be two numbers in [0, 1)")
    if not o.eps > 0:
        problems.append(f"eps={o.eps} must be > 0")
    if not o.weight_decay >= 0:
        problems.append(f"weight_decay={o.weight_decay} must be >= 0")
    if o.grad_clip is not None and not o.grad_clip > 0:
        problems.append(f"grad_clip={o.grad_clip} must be > 0, or None for no clipping")
    if problems:
        raise InvalidRequestError("invalid AdamW: " + "; ".join(problems))


class WorkerJob:
    """One open job: its weights, its optimizer and its counters; one method per call kind."""

    def __init__(
        self,
        spec: JobSpec,
        base: BaseModel,
        weights: Weights,
        *,
        vllm: VllmSampler | None = None,
        key: str | None = None,
        progress: Progress | None = None,
        settings: TrainerSettings | None = None,
    ) -> None:
        self.spec = spec
        self.base = base
        self.weights = weights
        self.settings = settings or TrainerSettings()
        self.checkpointing = (
            base.num_params >= self.settings.checkpointing_min_params
            if spec.gradient_checkpointing is None
            else spec.gradient_checkpointing
        )
        # Where this job samples if not with hf: a shared engine serving its adapter under ``key``,
        # or (a full fine-tune job, ``key`` None) an engine of its own, which it closes.
        self.vllm = vllm
        self.key = key
        self.progress = progress or Progress()  # ticked as a call advances: a hung call stops it
        # A job on several workers (a gang): this member's process group, set by the engine for
        # each call. Each member runs its share of a call's rows (``rows.member_rows``); gradients
        # meet by FSDP2's reduce-scatters (sharded weights) or an all-reduce at ``optim_step``
        # (replicated LoRA adapters: data parallel).
        self.gang: Gang | None = None
        self.optimizer = _new_optimizer(weights, spec.optimizer)
        self.step = 0
        self.weight_version = 0
        self.generate_calls = 0
        self.pending_tokens = 0  # completion tokens whose gradients await optim_step
        # What the sampler serves: the trainer's weights as of step ``_published_step``, and (for a
        # job that takes snapshots) a host copy of them, since the trainer may step on before a sync.
        self._published_step = 0
        self._published: dict[str, Tensor] | None = None
        self.host_state: dict[str, Tensor] | None = None  # set while the state is in the host store
        self._publish(weights.trainer_params, initial=True)

    def opened(self) -> Opened:
        trainable = sum(p.numel() for p in self.weights.trainer_params.values())
        return Opened(
            weight_version=self.weight_version,
            trainable_params=trainable,
            total_params=self.weights.total_params,
            state_bytes=planned_state_bytes(self),
            snapshots=self._published is not None,
        )

    @property
    def keeps_served_weights(self) -> bool:
        """Whether it can always say what its sampler serves (``served_tensors``), even after its
        trainer stepped on: only a job that takes snapshots keeps a copy."""
        return self._published is not None

    def take_snapshots(self) -> None:
        """From now on keep a host copy of what the sampler serves, for ``snapshot`` (call it
        right after opening, while the sampler serves the trainer's initial weights)."""
        self._published = {k: t.detach().to("cpu", copy=True) for k, t in self._trained().items()}

    def generate(self, prompts: Ragged, params: SamplingParams) -> Generated:
        return self.generate_async(prompts, params).result()

    def generate_async(self, prompts: Ragged, params: SamplingParams, priority: int = 0) -> Future[Generated]:
        """Checks now (a bad call raises here); samples on vLLM in the background, or with hf now."""
        params.validate()
        engine_max_len = None if self.vllm is None else self.vllm.max_model_len
        self.base.check_tokens(
            prompts, "prompts", min_len=1, extra_positions=params.max_tokens, engine_max_len=engine_max_len
        )
        bad = [t for t in params.stop_token_ids if t >= self.base.vocab_size]
        if bad:
            raise InvalidSamplingParamsError(
                f"stop_token_ids {bad} are outside the vocabulary [0, {self.base.vocab_size})"
            )
        if params.stop:
            require_tokenizer(self.base.path)
        # Generates arrive seeded (the client's Job, or the coordinator, seeds each by its index, so a
        # retry on another worker samples the same); this counter seeds the calls of in-process use.
        seed = generate_seed(self.spec.seed, self.generate_calls) if params.seed is None else params.seed
        self.generate_calls += 1
        if self.vllm is not None:
            return self.vllm.submit(
                self.key,
                prompts,
                params,
                seed=seed,
                stop_token_ids=self.base.stop_token_ids,
                weight_version=self.weight_version,
                priority=priority,
            )
        done: Future[Generated] = Future()
        done.set_result(self._generate_hf(prompts, params, seed))
        return done

    def _generate_hf(self, prompts: Ragged, params: SamplingParams, seed: int) -> Generated:
        with self._autocast():
            return hf.generate(
                self.weights.sampler_model(),
                prompts,
                params,
                seed=seed,
                stop_token_ids=self.base.stop_token_ids,
                pad_token_id=self.base.pad_token_id,
                tokenizer=self.base.tokenizer if params.stop else None,
                weight_version=self.weight_version,
                chunk_elements=self.settings.chunk_elements,
                tick=self.progress.tick,
            )

    def logprobs(self, tokens: Ragged) -> LogprobsResult:
        self.base.check_tokens(tokens, "tokens", min_len=1)
        tokens_B_T, valid_B_T = self._pad_right(tokens)
        logp_B_T1 = torch.zeros((len(tokens), tokens_B_T.shape[1] - 1), dtype=torch.float32, device=tokens_B_T.device)
        model = self.weights.trainer_model(train=False)
        for r, n in self._passes(tokens.lengths(), np.arange(len(tokens)), tokens_B_T.device):
            self.progress.tick()
            if r is None:
                self._idle_pass(train=False)
                continue
            with torch.no_grad(), self._autocast():
                logp_B_T1[r, : n - 1] = target_logprobs(
                    model, tokens_B_T[r, :n], valid_B_T[r, 1:n], 1.0, self.settings.chunk_elements
                )
        if self.gang is not None:  # each member filled its rows (zeros elsewhere): the sum is every row
            self.gang.all_reduce_([logp_B_T1])
        self.progress.tick()
        values = logp_B_T1[valid_B_T[:, 1:]].cpu().numpy().astype(np.float32)
        offsets = np.zeros(len(tokens) + 1, dtype=np.int64)
        np.cumsum(tokens.lengths() - 1, out=offsets[1:])
        return LogprobsResult(logprobs=Ragged(values=values, offsets=offsets))

    def forward_backward(
        self, batch: Batch, loss: str, config: LossConfig, forward_only: bool = False, return_logprobs: bool = False
    ) -> ForwardBackwardResult:
        """Accumulate the gradient of ``loss`` on ``batch`` (``forward_only``: only compute it);
        ``return_logprobs``: also return each completion token's logprob under the trainer."""
        batch.validate(loss)
        check_loss_config(config)
        self.base.check_tokens(batch.tokens, "batch.tokens", min_len=2)
        staleness = self._check_staleness(batch)
        if batch.sampler_logprobs is not None and not np.all(np.isfinite(batch.sampler_logprobs.values)):
            raise BatchShapeError("sampler_logprobs contains NaN or inf; pass the sampler's finite logprobs")
        tokens_B_T, valid_B_T = self._pad_right(batch.tokens)
        device = tokens_B_T.device
        # Target t (tokens[:, 1:]) is a completion token when prompt_len <= t < len.
        pos_T1 = torch.arange(1, tokens_B_T.shape[1], device=device)
        prompt_B1 = torch.from_numpy(batch.prompt_lens_B.astype(np.int64)).to(device)[:, None]
        completion_B_T1 = (pos_T1 >= prompt_B1) & valid_B_T[:, 1:]
        mask_B_T1 = completion_B_T1
        if batch.loss_mask is not None:  # observation tokens are context, not actions
            mask_B_T1 = torch.zeros_like(completion_B_T1)
            mask_B_T1[completion_B_T1] = torch.from_numpy(batch.loss_mask.values.astype(np.bool_)).to(device)
        sampler_logp_B_T1 = advantages_B = None
        if batch.sampler_logprobs is not None:
            sampler_logp_B_T1 = torch.zeros(mask_B_T1.shape, dtype=torch.float32, device=device)
            sampler_logp_B_T1[completion_B_T1] = torch.from_numpy(batch.sampler_logprobs.values.astype(np.float32)).to(
                device
            )
        if batch.advantages_B is not None:
            advantages_B = torch.from_numpy(batch.advantages_B.astype(np.float32)).to(device)
        per_token = {}  # Tinker's per-token weights and advantages, laid out like the targets
        for name in ("token_weights", "token_advantages"):
            values: Ragged | None = getattr(batch, name)
            if values is not None:
                per_token[name] = torch.zeros(mask_B_T1.shape, dtype=torch.float32, device=device)
                per_token[name][completion_B_T1] = torch.from_numpy(values.values.astype(np.float32)).to(device)
        token_weights_B_T1, token_advantages_B_T1 = per_token.get("token_weights"), per_token.get("token_advantages")
        # Rows whose loss is zero at every token whatever the weights (a GRPO group whose rewards
        # were all equal: advantage 0) add nothing to the gradient: they are not run through the
        # model, and their tokens still count in the mean, so the step is the one they would give.
        live = ~_zero_loss_rows(loss, config, mask_B_T1, advantages_B, token_advantages_B_T1,
                                forward_only or return_logprobs)  # fmt: skip
        idle_tokens = int(mask_B_T1[~live].sum())
        recomputed_B = self._at_sampling_weights(batch, loss, device)
        # Logits only where a loss is taken or a logprob asked for (a prompt's positions need none).
        select_B_T1 = (mask_B_T1 | completion_B_T1) if return_logprobs else mask_B_T1
        logp_B_T1 = torch.zeros(mask_B_T1.shape, dtype=torch.float32, device=device) if return_logprobs else None
        kl = loss in ("grpo", "decoupled_ppo") and config.kl_coef > 0
        chunk = self.settings.chunk_elements
        outs: list[LossOutput] = []
        failure: str | None = None  # a gang member's: the members exchange them and all fail alike
        try:
            for r, n in self._passes(batch.tokens.lengths(), np.flatnonzero(live.cpu().numpy()), device):
                self.progress.tick()
                if r is None:
                    self._idle_pass(train=not forward_only)
                    continue
                tokens, select = tokens_B_T[r, :n], select_B_T1[r, : n - 1]
                ref_logp = None
                if kl:
                    with self.base.reference() as reference, torch.no_grad(), self._autocast():
                        ref_logp = target_logprobs(reference, tokens, select, config.temperature, chunk)
                model = self.weights.trainer_model(train=True)
                set_checkpointing(model, self.checkpointing and not forward_only)
                with torch.enable_grad() if not forward_only else torch.no_grad(), self._autocast():
                    logp = target_logprobs(model, tokens, select, config.temperature, chunk)
                if logp_B_T1 is not None:
                    logp_B_T1[r, : n - 1] = logp.detach()
                advantages = None if advantages_B is None else advantages_B[r]
                if token_advantages_B_T1 is not None:
                    advantages = token_advantages_B_T1[r, : n - 1]
                out = compute_loss(
                    loss,
                    logp,
                    mask_B_T1[r, : n - 1],
                    config,
                    sampler_logp_B_T=None if sampler_logp_B_T1 is None else sampler_logp_B_T1[r, : n - 1],
                    advantages_B=advantages,
                    ref_logp_B_T=ref_logp,
                    weights_B_T=None if token_weights_B_T1 is None else token_weights_B_T1[r, : n - 1],
                    recomputed_B=None if recomputed_B is None else recomputed_B[r],
                )
                if not torch.isfinite(out.loss_sum):
                    message = (
                        f"{loss} loss is not finite ({out.loss_mean}); gradients were not accumulated. "
                        "Check the batch's sampler_logprobs and advantages"
                    )
                    if self.gang is None:
                        raise CallFailedError(message)
                    # A gang member runs on (its peers wait on its collectives); all discard after.
                    failure = failure or message
                if not forward_only:
                    out.loss_sum.backward()
                outs.append(out._replace(loss_sum=out.loss_sum.detach()))
        except Exception as e:
            if self.gang is not None and self.weights.sharded:  # stopped between its peers' collectives
                raise self.gang.breaks("forward_backward", e) from e
            if self.gang is None:
                if not outs or forward_only:
                    raise
                # Earlier micro-batches' gradients are in: none of a failed call may stay, and they
                # cannot be told from those accumulated before it.
                self._discard_gradients()
                raise CallFailedError(
                    f"forward_backward failed after {len(outs)} of its micro-batches ({type(e).__name__}: {e}); "
                    "the job's accumulated gradients were discarded and nothing was applied: submit this "
                    "step's forward_backward calls again"
                ) from e
            failure = failure or f"{type(e).__name__}: {e}"
        if self.gang is not None:
            outs = self._gathered(outs, failure, discard=not forward_only)
            if logp_B_T1 is not None:  # each member filled its rows (zeros elsewhere)
                self.gang.all_reduce_([logp_B_T1])
        out = combined(outs, idle_tokens)
        if not forward_only:
            if not outs:  # every row's loss was zero: a zero gradient, as a backward through them would give
                for param in self.weights.trainer_params.values():
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
            self.pending_tokens += out.num_tokens
        self.progress.tick()
        metrics = out.metrics if staleness is None else {**out.metrics, **staleness}
        logprobs = None
        if logp_B_T1 is not None:
            offsets = np.zeros(len(batch.tokens) + 1, dtype=np.int64)
            np.cumsum(batch.tokens.lengths() - batch.prompt_lens_B, out=offsets[1:])
            logprobs = Ragged(values=logp_B_T1[completion_B_T1].cpu().numpy().astype(np.float32), offsets=offsets)
        return ForwardBackwardResult(
            loss=out.loss_mean, num_tokens=out.num_tokens, metrics=metrics, loss_sum=float(out.loss_sum.detach()),
            logprobs=logprobs,
        )  # fmt: skip

    def _at_sampling_weights(self, batch: Batch, loss: str, device: torch.device) -> Tensor | None:
        """[B] bool for ``grpo``: the rows the trainer holds the sampling weights of (sampled by the
        version it serves, and no optimizer step since that version was published), whose PPO ratio
        is then taken against the trainer's own logprobs. None: no row (or no versions given)."""
        if loss != "grpo" or batch.weight_versions_B is None or self._published_step != self.step:
            return None
        return torch.from_numpy(batch.weight_versions_B == self.weight_version).to(device)

    def _microbatches(self, lengths: np.ndarray, rows: np.ndarray, device: torch.device) -> list[tuple[Tensor, int]]:
        """``rows`` (of rows of ``lengths``) in micro-batches: each its row indices and padded length."""
        pieces = microbatches(lengths[rows], self.settings.max_tokens_per_microbatch)
        return [(torch.from_numpy(rows[p]).to(device), int(lengths[rows[p]].max())) for p in pieces]

    def _passes(self, lengths: np.ndarray, rows: np.ndarray, device: torch.device) -> list[tuple[Tensor | None, int]]:
        """The micro-batches this worker runs of ``rows``: all of them, or in a gang its share.
        A sharded gang's members each run as many passes as the busiest one (each pass gathers
        every layer's shards from all of them): the rest are idle passes (``None``)."""
        gang = self.gang
        if gang is None:
            return list(self._microbatches(lengths, rows, device))
        mine: list[tuple[Tensor | None, int]] = list(
            self._microbatches(lengths, member_rows(lengths, rows, gang.rank, gang.world), device)
        )
        if not self.weights.sharded:
            return mine
        most = max(
            len(
                microbatches(
                    lengths[member_rows(lengths, rows, k, gang.world)], self.settings.max_tokens_per_microbatch
                )
            )
            for k in range(gang.world)
        )
        return mine + [(None, 2)] * (most - len(mine))

    def _idle_pass(self, train: bool) -> None:
        """A pass over one 2-token row whose loss is zero (``train``: with its backward, under the
        same checkpointing as the real passes): it takes part in a sharded gang's collectives and
        adds nothing to the gradients."""
        model = self.weights.trainer_model(train=train)
        if train:
            set_checkpointing(model, self.checkpointing)
        tokens = torch.full((1, 2), self.base.pad_token_id, dtype=torch.long, device=self.base.device)
        select = torch.ones((1, 1), dtype=torch.bool, device=self.base.device)
        with torch.enable_grad() if train else torch.no_grad(), self._autocast():
            logp = target_logprobs(model, tokens, select, 1.0, self.settings.chunk_elements)
        if train:
            (logp.sum() * 0.0).backward()

    def _gathered(self, outs: list[LossOutput], failure: str | None, discard: bool) -> list[LossOutput]:
        """Every gang member's micro-batch outputs, in rank order. If any member failed, every
        member discards the call's gradients (``discard``) and raises the same error."""
        assert self.gang is not None
        mine = msgspec.msgpack.encode((failure, [(float(o.loss_sum), o.num_tokens, o.metrics) for o in outs]))
        everyone = [msgspec.msgpack.decode(b) for b in self.gang.all_gather_bytes(mine)]
        failed = [(rank, said) for rank, (said, _) in enumerate(everyone) if said is not None]
        if failed:
            if discard:
                self._discard_gradients()
            rank, said = failed[0]
            raise CallFailedError(
                f"forward_backward failed on member {rank} of the job's {self.gang.world} workers ({said}); "
                "the job's accumulated gradients were discarded and nothing was applied: submit this step's "
                "forward_backward calls again"
            )
        device = self.base.device
        return [
            LossOutput(torch.tensor(total, dtype=torch.float32, device=device), n, metrics)
            for _, theirs in everyone
            for total, n, metrics in theirs
        ]

    def _autocast(self) -> Any:
        return autocast(self.base.device, self.base.dtype)

    def _check_staleness(self, batch: Batch) -> dict[str, float] | None:
        """Refuse samples older than ``max_staleness`` versions (0: only the current weights'), and
        say how stale what is trained on is: versions behind the trainer's, mean and max over the
        sampled tokens (rows, when the batch has no per-token versions). None: no versions given."""
        versions = batch.weight_versions_B
        if batch.token_versions is not None:
            versions = batch.token_versions.values
            if batch.loss_mask is not None:
                versions = versions[batch.loss_mask.values.astype(np.bool_)]
        if versions is None or not len(versions):
            return None
        behind = self.weight_version - versions.astype(np.int64)
        k = self.spec.max_staleness
        if np.any((behind < 0) | (behind > k)):
            bad = sorted({int(v) for v, d in zip(versions, behind, strict=True) if d < 0 or d > k})
            allowed = (
                f"version {self.weight_version}"
                if k == 0
                else f"versions {self.weight_version - k}..{self.weight_version}"
            )
            raise StaleSamplesError(
                f"the batch holds samples of weight version(s) {bad}, but the trainer is at version "
                f"{self.weight_version} and this job trains on {allowed} (max_staleness={k}): sample with "
                "newer weights, open the job with a larger max_staleness, or drop the batch's versions "
                "to train off-policy on purpose"
            )
        return {"staleness_mean": float(behind.mean()), "staleness_max": float(behind.max())}

    def optim_step(self, snapshot: bool = False, adam: AdamW | None = None, reduction: str = "mean") -> OptimStepResult:
        """Apply the accumulated gradient (of the mean loss over its tokens, or with ``reduction="sum"``
        of their summed loss) with the job's AdamW, or ``adam``'s settings for this step."""
        if reduction not in ("mean", "sum"):
            raise InvalidRequestError(f"optim_step reduction {reduction!r}: choose mean or sum")
        if adam is not None:
            check_adamw(adam)
        if self.pending_tokens == 0:
            raise CallFailedError("optim_step with no accumulated gradients: call forward_backward first")
        if self.gang is not None and not self.weights.sharded:  # data parallel: sum the members' gradients
            for p in self.weights.trainer_params.values():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self.gang.all_reduce_([p.grad for p in self.weights.trainer_params.values()])  # type: ignore[misc]
        params = [p for p in self.weights.trainer_params.values() if p.grad is not None]
        grads = [g for g in (p.grad for p in params) if g is not None]
        divisor = float(self.pending_tokens if reduction == "mean" else 1)
        if self.gang is not None and self.weights.sharded:  # FSDP2 reduced the members' sums to their mean
            divisor /= self.gang.world
        if divisor != 1.0:
            with torch.no_grad():
                for g in grads:
                    g.div_(divisor)
        total_norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(total_norm, DTensor):  # sharded gradients: the norm of the whole
            total_norm = total_norm.full_tensor()
        grad_norm = float(total_norm)
        if not math.isfinite(grad_norm):
            self._discard_gradients()
            raise CallFailedError(
                f"gradient norm is {grad_norm}: the step was not applied and the accumulated gradients "
                "were discarded; lower the learning rate or check the batch's advantages"
            )
        settings = adam or self.spec.optimizer
        clip = settings.grad_clip
        if clip is not None:
            torch.nn.utils.clip_grads_with_norm_(params, clip, total_norm)
        if adam is not None:
            for group in self.optimizer.param_groups:
                group.update(_optimizer_settings(adam))
        self.optimizer.step()
        self.progress.tick()
        self._discard_gradients()
        self.step += 1
        return OptimStepResult(step=self.step, grad_norm=grad_norm, snapshot=self.snapshot() if snapshot else None)

    def sync_weights(self, export: bool = False) -> Synced:
        self.weight_version += 1
        self._publish(self.weights.trainer_params)
        self._published_step = self.step
        return Synced(weight_version=self.weight_version, tensors=self._export() if export else None)

    def _export(self) -> dict[str, np.ndarray]:
        """The trainer weights as arrays, for another worker's sampler."""
        return {k: t.cpu().numpy().copy() for k, t in self._trained().items()}

    def served_weights(self) -> tuple[int, dict[str, np.ndarray]]:
        """The weights its sampler serves and their version, as arrays (for another worker)."""
        return self.weight_version, {k: t.detach().cpu().numpy().copy() for k, t in self.served_tensors().items()}

    def served_tensors(self) -> dict[str, Tensor]:
        """The weights its sampler serves: the trainer's if it has not stepped since they were
        published, else the copy a job with snapshots keeps (a job without one cannot say)."""
        if self._published_step == self.step:
            return self._trained()
        if self._published is None:
            raise CallFailedError("this job keeps no copy of its sampler's weights: it takes no snapshots")
        return dict(self._published)

    def set_weights(self, version: int, tensors: dict[str, np.ndarray]) -> Synced:
        """Serve ``tensors`` (another worker's trainer weights) as ``version``: a disaggregated
        job's sampler replica. Checks everything before changing anything."""
        params = self.weights.trainer_params
        wrong = sorted(set(tensors) ^ set(params)) + [
            k for k, t in tensors.items() if k in params and tuple(t.shape) != tuple(params[k].shape)
        ]
        if wrong:
            raise InvalidRequestError(f"pushed weights do not fit this job's (e.g. {wrong[:3]}): same spec needed")
        device = next(iter(params.values())).device
        self.weight_version = version
        self._publish({k: torch.from_numpy(np.asarray(t)).to(device) for k, t in tensors.items()})
        self._published_step = -1
        return Synced(weight_version=version)

    def save(self, path: str, fmt: str = "plexrl") -> Saved:
        """Checkpoint the trainer weights and optimizer; accumulated gradients are not saved. Or
        (``fmt`` "peft" or "hf") export the trainer weights for other tools."""
        if fmt != "plexrl":
            if fmt not in EXPORT_FORMATS:
                raise InvalidRequestError(f"save format {fmt!r}: choose plexrl, {', '.join(EXPORT_FORMATS)}")

            trained = self._trained()

            def fill(tmp: Path) -> dict[str, Any]:
                export.write(tmp, fmt, self.base, self.weights, trained)
                return {"export": fmt, "weight_version": self.weight_version, "step": self.step}

            if self._writes():
                checkpoint.write_dir(path, fill)
            return Saved(path=path, weight_version=self.weight_version, step=self.step)
        tensors = {k: t.cpu().contiguous() for k, t in self._trained().items()}
        optimizer_state = _whole_state(self.optimizer.state_dict())
        manifest = {
            "kind": self.weights.kind,
            "weight_version": self.weight_version,
            "step": self.step,
            "spec": msgspec.to_builtins(self.spec),
        }
        if self._writes():
            checkpoint.write(path, tensors, optimizer_state, manifest)
        return Saved(path=path, weight_version=self.weight_version, step=self.step)

    def load(self, path: str, export: bool = False, snapshot: bool = False) -> Loaded:
        """Restore a checkpoint into trainer and sampler; checks everything before changing anything.

        Accumulated gradients are discarded; the optimizer keeps this job's spec hyperparameters.
        """
        ckpt = checkpoint.read(path)
        kind = ckpt.manifest["kind"]
        if kind != self.weights.kind:
            raise CallFailedError(f"{path!r} holds a {kind} checkpoint but this job is {self.weights.kind}")
        step, version = ckpt.manifest["step"], ckpt.manifest["weight_version"]
        self._set_state(ckpt.tensors, ckpt.optimizer_state, step, version, f"{path!r}")
        self._publish(self.weights.trainer_params)  # with vLLM, this can still fail (the engine died): the call fails
        self._published_step = step
        tensors = self._export() if export else None
        snap = self.snapshot() if snapshot else None
        return Loaded(path=path, weight_version=version, step=step, tensors=tensors, snapshot=snap)

    def snapshot(self) -> Snapshot:
        """The job's state for a ``Restore`` elsewhere (the job must be opened with ``snapshots``)."""
        buffer = io.BytesIO()
        torch.save(_whole_state(self.optimizer.state_dict()), buffer)
        sampler = None
        if self._published_step != self.step:  # stepped since the last sync: the sampler serves older weights
            if self._published is None:
                raise CallFailedError("this job keeps no copy of its sampler's weights: it takes no snapshots")
            sampler = {k: t.numpy() for k, t in self._published.items()}
        return Snapshot(
            step=self.step,
            weight_version=self.weight_version,
            trainer=self._export(),
            optimizer=buffer.getvalue(),
            sampler=sampler,
        )

    def restore(self, snapshot: Snapshot | None, replay: list[ForwardBackward | SyncWeights]) -> None:
        """Become the job ``snapshot`` describes (None: as opened), then run ``replay`` in order."""
        if snapshot is not None:
            try:
                optimizer_state = torch.load(io.BytesIO(snapshot.optimizer), map_location="cpu", weights_only=True)
            except Exception as e:  # torch.load raises several unrelated types on bad bytes
                raise CallFailedError(f"the snapshot's optimizer state is unreadable ({e})") from e
            tensors = {k: torch.from_numpy(np.asarray(t)) for k, t in snapshot.trainer.items()}
            self._set_state(tensors, optimizer_state, snapshot.step, snapshot.weight_version, "the snapshot")
            served = snapshot.sampler
            if served is None:
                self._publish(self.weights.trainer_params)
            else:
                self._publish({k: torch.from_numpy(np.asarray(t)) for k, t in served.items()})
            self._published_step = self.step if served is None else -1
        for call in replay:
            match call:
                case ForwardBackward(batch=batch, loss=loss, loss_config=config):
                    self.forward_backward(batch, loss, config)
                case SyncWeights():
                    self.sync_weights()

    def _set_state(
        self, tensors: dict[str, Tensor], optimizer_state: dict[str, Any], step: int, version: int, source: str
    ) -> None:
        """Take trainer weights, optimizer state and counters from ``source`` (a checkpoint or a
        snapshot); checks everything before changing anything."""
        params = self.weights.trainer_params
        mismatched = sorted(set(tensors) ^ set(params)) + [
            k for k, t in tensors.items() if k in params and t.shape != params[k].shape
        ]
        if mismatched:
            raise CallFailedError(
                f"{source} does not fit this job's weights (e.g. {mismatched[:3]}); "
                "open the job with the spec it was saved with (same model and LoRA rank/targets)"
            )
        optimizer = _new_optimizer(self.weights, self.spec.optimizer)
        try:
            optimizer.load_state_dict(_sharded_state(optimizer_state, list(params.values())))
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise CallFailedError(f"{source}: the optimizer state does not fit this job ({e})") from e
        for p in params.values():
            for name, value in optimizer.state.get(p, {}).items():
                if isinstance(value, Tensor) and value.ndim > 0 and value.shape != p.shape:
                    raise CallFailedError(f"{source}: optimizer state {name!r} has shape {tuple(value.shape)}")
        for group in optimizer.param_groups:
            group.update(_optimizer_settings(self.spec.optimizer))
        # Everything is checked: from here on nothing can fail half-way.
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(_shard_like(tensors[k], p))
        self._discard_gradients()
        self.optimizer = optimizer
        self.step = step
        self.weight_version = version

    def close(self) -> Closed:
        self._discard_gradients()
        if self.vllm is not None and self.key is not None:
            self.vllm.drop_adapter(self.key)
        elif self.vllm is not None:
            self.vllm.close()
        self.vllm = None
        self.weights.close()
        return Closed()

    def _publish(self, tensors: dict[str, nn.Parameter] | dict[str, Tensor], initial: bool = False) -> None:
        """Make the sampler serve ``tensors`` as version ``weight_version`` (the caller sets
        ``_published_step``: the step whose trainer weights they are, -1 for other weights)."""
        tensors = {k: _whole(t).detach() for k, t in tensors.items()}
        if self._published is not None:
            self._published = {k: t.to("cpu", copy=True) for k, t in tensors.items()}
        if self.vllm is not None and self.key is not None:
            self.vllm.set_adapter(self.key, self.weight_version, dict(tensors), self.weights.adapter_config())
            return
        if self.vllm is not None:
            if not initial:  # a new engine starts with the base weights, which a new job has
                self.vllm.refit(dict(tensors))
            return
        with torch.no_grad():
            for k, t in tensors.items():
                self.weights.sampler_params[k].copy_(t)

    def _trained(self) -> dict[str, Tensor]:
        """The trainer's weights, whole (a sharded job's gathered from its gang: every member calls this)."""
        return {k: _whole(p).detach() for k, p in self.weights.trainer_params.items()}

    def _writes(self) -> bool:
        """Whether this worker writes the job's files: in a gang, the leader only."""
        return self.gang is None or self.gang.leader

    def _discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.pending_tokens = 0

    def _pad_right(self, rows: Ragged) -> tuple[Tensor, Tensor]:
        """``tokens_B_T`` padded on the right and ``valid_B_T``, true on real tokens."""
        lens_B = torch.from_numpy(rows.lengths().astype(np.int64))
        valid_B_T = torch.arange(int(lens_B.max())) < lens_B[:, None]
        tokens_B_T = torch.full(valid_B_T.shape, self.base.pad_token_id, dtype=torch.long)
        tokens_B_T[valid_B_T] = torch.from_numpy(rows.values.astype(np.int64))
        device = next(iter(self.weights.trainer_params.values())).device
        return tokens_B_T.to(device), valid_B_T.to(device)


def _zero_loss_rows(
    loss: str,
    config: LossConfig,
    mask_B_T1: Tensor,
    advantages_B: Tensor | None,
    token_advantages_B_T1: Tensor | None,
    keep_all: bool,
) -> Tensor:
    """[B] bool: the rows whose loss is zero at every token, whatever the model says (the policy
    losses scale every token by its advantage, so a row of zero advantages, without a KL term,
    adds nothing). No row with ``keep_all`` (their logprobs or metrics are asked for)."""
    none = torch.zeros(mask_B_T1.shape[0], dtype=torch.bool, device=mask_B_T1.device)
    if keep_all or loss == "cross_entropy" or config.kl_coef > 0:
        return none
    if token_advantages_B_T1 is not None:
        return ~((token_advantages_B_T1 != 0) & mask_B_T1).any(dim=1)
    if advantages_B is not None:
        return advantages_B == 0
    return none


def _whole(t: Tensor) -> Tensor:
    """``t`` whole: a sharded tensor (a DTensor) gathered from its gang (a collective)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _shard_like(whole: Tensor, like: Tensor) -> Tensor:
    """``whole`` laid out as ``like``: this member's shard if ``like`` is sharded (no collective)."""
    if not isinstance(like, DTensor):
        return whole
    whole = whole.to(like.device, like.dtype)
    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)


def _whole_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer ``state_dict`` with its sharded moments whole (the single-device layout)."""
    per_param = {
        i: {k: _whole(v) if isinstance(v, Tensor) else v for k, v in s.items()} for i, s in state["state"].items()
    }
    return {**state, "state": per_param}


def _sharded_state(state: dict[str, Any], params: list[nn.Parameter]) -> dict[str, Any]:
    """A whole optimizer ``state_dict`` with each parameter's moments laid out as the parameter."""
    if not any(isinstance(p, DTensor) for p in params):
        return state
    per_param = {
        i: {
            k: _shard_like(v, params[int(i)]) if isinstance(v, Tensor) and v.ndim > 0 and int(i) < len(params) else v
            for k, v in s.items()
        }
        for i, s in state.get("state", {}).items()
    }
    return {**state, "state": per_param}


def _optimizer_settings(o: AdamW) -> dict[str, Any]:
    return {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}


def _new_optimizer(weights: Weights, o: AdamW) -> torch.optim.AdamW:
    return torch.optim.AdamW(list(weights.trainer_params.values()), **_optimizer_settings(o))
