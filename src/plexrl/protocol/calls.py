"""The calls a job makes and their results: what a worker's engine executes.

A call travels client -> coordinator (inside ``Submit``) -> worker (inside ``Execute``)
unchanged, and its result travels back the same way. New fields get defaults and go last.
"""

from __future__ import annotations

from typing import cast

import msgspec
import numpy as np

from plexrl.names import CALL_KINDS, CallKind
from plexrl.types import AdamW, Batch, LoRA, LossConfig, Ragged, Sample, SamplingParams


class JobSpec(msgspec.Struct, frozen=True):
    """What a job trains: a base model, a LoRA adapter on it (or a full copy), an optimizer."""

    model: str  # path of a transformers model directory on the worker's host
    lora: LoRA | None = LoRA()  # None = full fine-tune (a private copy of the base weights)
    optimizer: AdamW = AdamW()
    seed: int = 0
    # Samples of weights at most this many versions older than the trainer's are trained on
    # (0 = strictly on-policy); older ones are refused with StaleSamplesError.
    max_staleness: int = 0
    # Checkpoint the decoder layers in training (recompute their activations in the backward):
    # None = the worker decides by the model's size (on from 100M parameters).
    gradient_checkpointing: bool | None = None


# -- calls ------------------------------------------------------------------------------------


class Open(msgspec.Struct, tag="open", frozen=True):
    """Create the job's state on its home worker (the first call of every job); ``replica``: on
    a disaggregated job's sampler worker, where only its sampler is used."""

    spec: JobSpec
    replica: bool = False
    tenant: str = ""  # whose job: names its checkpoint folder on the worker (set by the coordinator)
    # Set by the coordinator, which recovers jobs from snapshots of at most this many bytes: the
    # worker makes a job snapshot-taking (it keeps a host copy of what its sampler serves) if its
    # state is no larger, and says so in ``Opened.snapshots``. 0: no snapshots.
    snapshot_max_bytes: int = 0


class Snapshot(msgspec.Struct, frozen=True):
    """A job's whole state on its worker right after an optimizer step (or a load): what a
    ``Restore`` on another worker rebuilds it from, kept by the coordinator."""

    step: int  # optimizer steps applied
    weight_version: int  # the version the sampler serves
    trainer: dict[str, np.ndarray]  # the trainer's weights
    optimizer: bytes  # its optimizer's state_dict, torch.save'd (read back with weights_only=True)
    sampler: dict[str, np.ndarray] | None = None  # what the sampler serves; None: the trainer's weights


class Generate(msgspec.Struct, tag="generate", frozen=True):
    prompts: Ragged  # int32 token ids
    params: SamplingParams = SamplingParams()


class Logprobs(msgspec.Struct, tag="logprobs", frozen=True):
    """Per-token logprobs of ``tokens[1:]`` under the trainer's current weights."""

    tokens: Ragged  # int32


class ForwardBackward(msgspec.Struct, tag="forward_backward", frozen=True):
    batch: Batch
    loss: str = "grpo"
    loss_config: LossConfig = LossConfig()
    forward_only: bool = False  # compute the loss and logprobs, accumulate no gradient
    return_logprobs: bool = False  # the result carries each completion token's logprob under the trainer


class OptimStep(msgspec.Struct, tag="optim_step", frozen=True):
    snapshot: bool = False  # also return the job's Snapshot after the step (set by the coordinator)
    # This step's AdamW settings instead of the job's (Tinker sends them with every step); None: the job's.
    adam: AdamW | None = None
    # "mean": the gradient of the mean loss over the tokens accumulated since the last step (plexrl's);
    # "sum": of their summed loss (Tinker's losses are sums).
    reduction: str = "mean"


class WeightSource(msgspec.Struct, frozen=True):
    """Where a job's published weights can be fetched from: a worker's data plane
    (``worker/dataplane.py``). The coordinator passes it on; the weights never go through it."""

    address: str  # the serving worker's data-plane endpoint, tcp://HOST:PORT
    key: bytes  # its CurveZMQ public key (b"": a loopback cluster without keys)
    job_id: str
    weight_version: int
    token: bytes  # the capability to fetch these weights: only their holder's requests are answered
    nbytes: int  # the weights' size, the fetcher's message limit
    local: str = ""  # ipc:// endpoint for fetchers on the same host (a 0700 folder: this user's processes only)


class SyncWeights(msgspec.Struct, tag="sync_weights", frozen=True):
    """Publish the trainer's weights to the sampler; the weight version goes up by one.
    ``export``: also publish them for other workers' samplers (a disaggregated or pooled job);
    ``inline``: return the tensors themselves instead, to go through the coordinator (the
    baseline ``bench/weights.py`` measures the data plane against)."""

    export: bool = False
    inline: bool = False


class SetWeights(msgspec.Struct, tag="set_weights", frozen=True):
    """The coordinator's push of a disaggregated or pooled job's new weights to a sampler worker:
    fetched from ``source`` (the home worker's data plane), or given as ``tensors`` (inline)."""

    weight_version: int
    tensors: dict[str, np.ndarray] | None = None
    source: WeightSource | None = None
    exported_at: float = 0.0  # when the home worker had them exported (wall clock): times the push


class Save(msgspec.Struct, tag="save", frozen=True):
    path: str
    # "plexrl": a checkpoint (weights and optimizer) that load() restores; "peft" or "hf": the
    # trainer's weights for other tools (worker/export.py), which load() refuses.
    format: str = "plexrl"


class Load(msgspec.Struct, tag="load", frozen=True):
    path: str
    export: bool = False  # also publish the loaded weights (for a disaggregated job's sampler worker)
    snapshot: bool = False  # also return the job's Snapshot after the load (set by the coordinator)


class Close(msgspec.Struct, tag="close", frozen=True):
    """Free the job's state on its worker (the last call of every job)."""


class Restore(msgspec.Struct, tag="restore", frozen=True):
    """Rebuild a job whose worker was lost, on a new one (sent by the coordinator): open it, set
    its state to ``snapshot`` (None: as it opened), then run ``replay``, the job's
    ``forward_backward`` and ``sync_weights`` calls since that snapshot, in order. Answered with
    ``Opened``."""

    open: Open
    snapshot: Snapshot | None
    replay: list[ForwardBackward | SyncWeights] = []
    export: bool = False  # also publish the weights its sampler serves (a pooled job's rollout workers fetch them)


Call = (
    Open | Generate | Logprobs | ForwardBackward | OptimStep | SyncWeights | SetWeights | Save | Load | Close | Restore
)


def generate_seed(job_seed: int, index: int) -> int:
    """The seed of a job's ``index``-th generate that names none: independent of every other
    job's activity and of which worker runs it."""
    state = np.random.SeedSequence([job_seed % (1 << 64), index]).generate_state(1, np.uint64)
    return int(state[0]) >> 1


# -- results ----------------------------------------------------------------------------------


class Opened(msgspec.Struct, tag="opened", frozen=True):
    weight_version: int
    trainable_params: int
    total_params: int
    state_bytes: int = 0  # the job's movable state on its worker's device (what residency moves)
    snapshots: bool = False  # its optim_steps and loads return a Snapshot when asked (see Open)
    source: WeightSource | None = None  # after Restore(export=True): where its sampler's weights are published


class Generated(msgspec.Struct, tag="generated", frozen=True):
    """Completions in prompt-major order: ``n`` rows for prompt 0, then ``n`` for prompt 1, ..."""

    tokens: Ragged  # int32, completion only
    logprobs: Ragged  # float32, the sampler's logprob of each sampled token
    prompt_index_B: np.ndarray  # int32
    finish_reasons: list[str]
    weight_version: int
    cached_tokens_P: np.ndarray | None = None  # int32 per prompt: its tokens vLLM's prefix cache served

    @property
    def samples(self) -> list[Sample]:
        return [
            Sample(int(i), self.tokens[k], self.logprobs[k], self.finish_reasons[k], self.weight_version)
            for k, i in enumerate(self.prompt_index_B)
        ]

    def groups(self) -> list[list[Sample]]:
        """The samples of each prompt, in prompt order (a GRPO group per prompt)."""
        out: dict[int, list[Sample]] = {}
        for s in self.samples:
            out.setdefault(s.prompt_index, []).append(s)
        return [out[i] for i in sorted(out)]


class LogprobsResult(msgspec.Struct, tag="logprobs_result", frozen=True):
    logprobs: Ragged  # float32, len(tokens_i) - 1 per row


class ForwardBackwardResult(msgspec.Struct, tag="forward_backward_result", frozen=True):
    loss: float  # the mean over the tokens in the loss (``loss_sum / num_tokens``)
    num_tokens: int
    # Token means of the loss's terms (ratio_mean, clip_frac, ...) over the rows the trainer ran:
    # rows whose loss is zero at every token (advantage 0, no KL term) are not run, unless
    # ``return_logprobs`` asks for their logprobs; their tokens count in ``num_tokens`` all the same.
    metrics: dict[str, float] = {}
    loss_sum: float = 0.0
    logprobs: Ragged | None = None  # with ``return_logprobs``: per completion token, float32


class OptimStepResult(msgspec.Struct, tag="optim_step_result", frozen=True):
    step: int  # optimizer steps applied so far
    grad_norm: float
    snapshot: Snapshot | None = None  # with OptimStep(snapshot=True) only (the coordinator keeps it)


class Synced(msgspec.Struct, tag="synced", frozen=True):
    weight_version: int
    tensors: dict[str, np.ndarray] | None = None  # with SyncWeights(inline=True), or from the engine to its worker
    source: WeightSource | None = None  # with SyncWeights(export=True): where they are published
    exported_at: float = 0.0  # with tensors or source: when the home worker had them (wall clock)
    # A disaggregated job's sync: seconds from the export on its home worker to the weights in its
    # sampler worker's memory (the push alone; loading them into the engine comes after).
    push_s: float = 0.0


class Saved(msgspec.Struct, tag="saved", frozen=True):
    path: str
    weight_version: int
    step: int


class Loaded(msgspec.Struct, tag="loaded", frozen=True):
    path: str
    weight_version: int
    step: int
    tensors: dict[str, np.ndarray] | None = None  # from the engine to its worker, with Load(export=True)
    snapshot: Snapshot | None = None  # with Load(snapshot=True) only (the coordinator keeps it)
    source: WeightSource | None = None  # with Load(export=True): where the loaded weights are published


class Closed(msgspec.Struct, tag="closed", frozen=True):
    pass


Result = (
    Opened | Generated | LogprobsResult | ForwardBackwardResult | OptimStepResult | Synced | Saved | Loaded | Closed
)

CALL_KIND: dict[type, CallKind] = {
    t: cast(CallKind, t.__struct_config__.tag)
    for t in (Open, Generate, Logprobs, ForwardBackward, OptimStep, SyncWeights, SetWeights, Save, Load, Close, Restore)
}
assert sorted(CALL_KIND.values()) == sorted(CALL_KINDS), "protocol/names.py's call kinds are the calls' tags"
