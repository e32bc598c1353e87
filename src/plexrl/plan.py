"""The device memory plan: what a worker's device holds, in bytes, from model shapes and settings.

Pure arithmetic, one copy for everyone: a worker reports its device and settings (``WorkerPlan``,
in its registration), a client sizes its job from the model's ``config.json`` before it is
placed (``JobShape``), the coordinator's scheduler places by ``footprint`` and refuses a job that
fits no worker with ``explain``'s numbers, and ``bench/memory.py`` prints the same plan for
Qwen3-1.7B and Qwen3-8B on an 80 GB card.

What a device holds, counted once each:
- **base weights**, once per base model in the trainer's process (frozen, compute dtype);
- **engines**: vLLM's reservation, once per base (the engine every LoRA job of that base shares;
  its weights, LoRA slots and KV inside it) and once per full fine-tune job (an engine of its own);
- **activation headroom** for one micro-batch of ``max_tokens_per_microbatch`` tokens, once per base;
- each job's **state**: trained weights, their gradients and two AdamW moments (float32 masters:
  16 bytes a parameter), plus an hf sampler's copy; this is what residency moves in and out.

Engines and activations need not be held at once: on a GPU a worker's vLLM engines can sleep while
its trainer runs (``engine_sleep``), so the device's peak is the larger of the two, not their sum
(``held_bytes``). The scheduler sleeps them when a training call would not fit beside them
(``must_sleep``), at the level ``sleep_level`` picks, and wakes them before the next call that
samples or changes what they serve.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec

from plexrl.names import CallKind, EngineSleep

GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Float32 master weight, its gradient and AdamW's two moments.
STATE_BYTES_PER_TRAINED_PARAM = 16
# The CUDA context, cuBLAS workspaces and the caching allocator's fragmentation, per process.
CUDA_RUNTIME_BYTES = 3 * GiB // 2
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ModelShape(msgspec.Struct, frozen=True):
    """What the plan needs of a decoder (Qwen2/Qwen3/Llama-style), read from its ``config.json``."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    context: int  # max_position_embeddings
    qkv_bias: bool = False  # Qwen2's q/k/v projections have biases
    qk_norm: bool = False  # Qwen3's per-head q/k RMSNorms

    @classmethod
    def of(cls, config: dict[str, Any]) -> ModelShape:
        """From a transformers config dict; ``KeyError`` / ``ValueError`` on a config it cannot read."""
        c = dict(config)
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        model_type = str(c.get("model_type", ""))
        return cls(
            vocab=int(c["vocab_size"]),
            hidden=hidden,
            intermediate=int(c["intermediate_size"]),
            layers=int(c["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or hidden // heads),
            tied=bool(c.get("tie_word_embeddings", False)),
            context=int(c.get("max_position_embeddings") or 0),
            qkv_bias=model_type == "qwen2" or bool(c.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
        )

    @classmethod
    def read(cls, model_dir: str | Path) -> ModelShape | None:
        """The shape of the model directory ``model_dir``, or None if there is no readable config here."""
        try:
            return cls.of(json.loads((Path(model_dir) / "config.json").read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def linears(self) -> dict[str, tuple[int, int]]:
        """Each decoder layer's linear layers: (in features, out features)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def params(self) -> int:
        """Every parameter (a tied output layer counted once)."""
        linears = self.linears()
        per_layer = sum(a * b for a, b in linears.values()) + 2 * self.hidden  # two RMSNorms
        if self.qkv_bias:
            per_layer += sum(linears[n][1] for n in ("q_proj", "k_proj", "v_proj"))
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        embedding = self.vocab * self.hidden
        return embedding * (1 if self.tied else 2) + self.layers * per_layer + self.hidden

    def lora_params(self, rank: int, targets: tuple[str, ...] = LINEARS) -> int:
        """A rank-``rank`` adapter on ``targets`` of every layer: ``rank x (in + out)`` each."""
        linears = self.linears()
        return self.layers * sum(rank * sum(linears[t]) for t in targets if t in linears)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


class JobShape(msgspec.Struct, frozen=True):
    """What a job trains, as the plan sizes it before it is placed."""

    model: ModelShape
    lora_rank: int = 0  # 0: a full fine-tune
    lora_targets: tuple[str, ...] = LINEARS
    checkpointing: bool | None = None  # the job's gradient_checkpointing (None: by the model's size)
    devices: int = 1  # a gang's members: a full fine-tune's trained state is sharded over them (FSDP2)

    @property
    def trained_params(self) -> int:
        return self.model.params if self.lora_rank == 0 else self.model.lora_params(self.lora_rank, self.lora_targets)


class WorkerPlan(msgspec.Struct, frozen=True):
    """A worker's device and the settings that decide what it holds (sent when it registers)."""

    capacity_bytes: int  # the device's memory (a GPU's total; on CPU, the machine's RAM)
    device_type: str = "cpu"  # "cuda" or "cpu"
    dtype: str = "float32"  # the compute dtype: frozen weights, engines, activations
    sampler: str = "hf"  # "vllm" or "hf"
    gpu_memory_utilization: float = 0.3  # CUDA: each vLLM engine's reservation, a share of capacity
    cpu_kv_cache_bytes: int = GiB  # CPU: each vLLM engine's KV space (VLLM_CPU_KVCACHE_SPACE)
    max_model_len: int = 8192
    max_loras: int = 32
    max_lora_rank: int = 8
    max_tokens_per_microbatch: int = 8192
    chunk_elements: int = 1 << 25
    checkpointing_min_params: int = 100_000_000
    # Whether its vLLM engines sleep while it trains: "auto" (when training would not fit beside
    # them), "always" (around every training phase, as colocated RL trainers do) or "never".
    engine_sleep: EngineSleep = "auto"
    host_bytes: int = 0  # the host's memory (what a level-1 sleep offloads the engines' weights to)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def runtime_bytes(self) -> int:
        return CUDA_RUNTIME_BYTES if self.device_type == "cuda" else 0


class Footprint(msgspec.Struct, frozen=True):
    """One job on one worker, in bytes."""

    state: int  # what residency moves: trained weights, gradients, AdamW moments (+ an hf sampler copy)
    pinned: int  # held wherever its state is, while it is open: a full fine-tune job's own engine
    base: int  # held once per base model on the worker: its weights, shared engine, activation headroom (held_bytes)
    parts: dict[str, int]  # every part by name (for a refusal's message and bench/memory.py)


def engine_bytes(worker: WorkerPlan, model: ModelShape, lora: bool) -> int:
    """A vLLM engine's device memory: its reservation on CUDA; on CPU its weights, LoRA slots and KV
    space. 0 with the hf sampler."""
    if worker.sampler != "vllm":
        return 0
    if worker.device_type == "cuda":
        return int(worker.gpu_memory_utilization * worker.capacity_bytes)
    return engine_needs(worker, model, lora) - kv_bytes(worker, model) + worker.cpu_kv_cache_bytes


def kv_bytes(worker: WorkerPlan, model: ModelShape) -> int:
    """KV for one sequence of the engine's longest (``max_model_len``)."""
    return min(worker.max_model_len, model.context or worker.max_model_len) * model.kv_bytes_per_token(
        worker.dtype_bytes
    )


def engine_needs(worker: WorkerPlan, model: ModelShape, lora: bool) -> int:
    """The least a vLLM engine can start in: its weights, LoRA slots (``max_loras`` adapters at
    ``max_lora_rank`` on every linear layer) and one longest sequence's KV."""
    slots = worker.max_loras * model.lora_params(worker.max_lora_rank) if lora else 0
    return (model.params + slots) * worker.dtype_bytes + kv_bytes(worker, model)


def checkpointing(worker: WorkerPlan, model: ModelShape, asked: bool | None = None) -> bool:
    """Whether a job checkpoints its layers: as asked, else by the model's size (as the worker decides)."""
    return model.params >= worker.checkpointing_min_params if asked is None else asked


def activation_bytes(worker: WorkerPlan, model: ModelShape, checkpointed: bool) -> int:
    """The trainer's headroom for one micro-batch (forward and backward of ``max_tokens_per_microbatch``
    tokens): what each layer keeps for the backward (only its input when checkpointed, plus one
    layer's worth recomputed), the final hidden states, and one chunk of logits (float32 and its
    compute-dtype copies, forward or backward: ``forward.HeadLogprobs``)."""
    b, h, i = worker.dtype_bytes, model.hidden, model.intermediate
    q = (model.heads + 2 * model.kv_heads) * model.head_dim
    # Per token, one layer: norms' float32 inputs, the attention's q/k/v, output and projection
    # inputs, the MLP's gate/up/activation/product, LoRA's float32 inputs.
    layer = (8 * h + 2 * q) * 4 + (6 * h + 2 * q + 5 * i) * b
    kept = model.layers * (h * b if checkpointed else layer) + (layer if checkpointed else 0)
    tokens = worker.max_tokens_per_microbatch
    logits = min(worker.chunk_elements, tokens * model.vocab) * (4 * 2 + 2 * b)
    return tokens * (kept + 3 * h * 4) + logits


def served_bytes(state_bytes: float, dtype_bytes: int = 2) -> int:
    """A job's served weights estimated from its movable state (``STATE_BYTES_PER_TRAINED_PARAM`` per
    trained parameter), in ``dtype_bytes``: where no plan gives its shape."""
    return int(dtype_bytes * state_bytes // STATE_BYTES_PER_TRAINED_PARAM)


def footprint(worker: WorkerPlan, job: JobShape) -> Footprint:
    """What ``job`` holds on ``worker``'s device."""
    model, lora = job.model, job.lora_rank > 0
    # On a gang, each member holds its share of a full fine-tune's state (FSDP2), and a LoRA
    # adapter's whole (data parallel: it is small).
    state = -(-job.trained_params * STATE_BYTES_PER_TRAINED_PARAM // (1 if lora else job.devices))
    if worker.sampler == "hf":  # it samples with a copy of its weights: an adapter in float32, a model in dtype
        state += job.trained_params * (4 if lora else worker.dtype_bytes)
    shared_engine = engine_bytes(worker, model, lora=True) if lora else 0
    own_engine = 0 if lora else engine_bytes(worker, model, lora=False)
    base_weights = model.params * worker.dtype_bytes
    activations = activation_bytes(worker, model, checkpointing(worker, model, job.checkpointing))
    parts = {
        "trained state": state,
        "base weights": base_weights,
        "activations": activations,
        "shared engine": shared_engine,
        "own engine": own_engine,
    }
    base = held_bytes(worker, base_weights, activations, shared_engine)
    return Footprint(state=state, pinned=own_engine, base=base, parts=parts)


def free_bytes(worker: WorkerPlan) -> int:
    """What jobs may use: the capacity less the runtime's share."""
    return worker.capacity_bytes - worker.runtime_bytes


TRAINING_KINDS: frozenset[CallKind] = frozenset(
    {"forward_backward", "optim_step", "logprobs"}
)  # the calls that need activations


def sleep_frees(worker: WorkerPlan) -> bool:
    """Whether sleeping the worker's engines gives their memory to its trainer: on CUDA (vLLM's
    sleep mode) unless turned off. On CPU a sleep only pauses the engine: it frees nothing."""
    return worker.sampler == "vllm" and worker.device_type == "cuda" and worker.engine_sleep != "never"


def held_bytes(worker: WorkerPlan, weights: int, activations: int, engines: int) -> int:
    """What the device holds beside jobs' movable state at its peak: the trainer's frozen weights,
    and its activation headroom and the engines' reservations, at once or, when the engines sleep
    for training, the larger of the two."""
    return weights + (max(activations, engines) if sleep_frees(worker) else activations + engines)


def must_sleep(worker: WorkerPlan, state: int, weights: int, activations: int, engines: int) -> bool:
    """Whether a training call must have the worker's engines asleep: always ("always", whatever the
    device), or ("auto") when the resident ``state``, the frozen ``weights``, the ``activations``
    and the awake ``engines`` together exceed the device."""
    if worker.sampler != "vllm" or engines == 0 or worker.engine_sleep == "never":
        return False
    if worker.engine_sleep == "always":
        return True
    return sleep_frees(worker) and state + weights + activations + engines > free_bytes(worker)


def sleep_level(worker: WorkerPlan, engines: int) -> int:
    """The level the engines sleep at: 1 (weights offloaded to the host, copied back on wake) when
    the host's memory holds twice their reservations, else 2 (weights dropped; a wake loads the
    trainer's current copy)."""
    return 1 if 2 * engines <= worker.host_bytes else 2


def refusal(worker: WorkerPlan, job: JobShape, fp: Footprint) -> str | None:
    """Why ``job`` cannot run on ``worker`` even alone, naming the numbers; None if it can."""
    if worker.sampler == "vllm":
        lora = job.lora_rank > 0
        needs, has = engine_needs(worker, job.model, lora), engine_bytes(worker, job.model, lora)
        if worker.device_type == "cuda" and needs > has:
            return (
                f"its vLLM engine needs {gib(needs)} (weights, LoRA slots and one {worker.max_model_len}-token "
                f"sequence's KV) but --gpu-memory-utilization {worker.gpu_memory_utilization} reserves "
                f"{gib(has)}: raise it, or lower --max-model-len / --max-loras"
            )
    parts = fp.parts
    total = fp.state + held_bytes(
        worker, parts["base weights"], parts["activations"], parts["shared engine"] + parts["own engine"]
    )
    if total > free_bytes(worker):
        named = ", ".join(f"{k} {gib(v)}" for k, v in parts.items() if v)
        sleeping = ", its engines asleep while it trains" if sleep_frees(worker) else ""
        return f"it needs {gib(total)} ({named}{sleeping}) and the device has {gib(free_bytes(worker))} for jobs"
    return None


def gib(n: float) -> str:
    """Bytes in GiB to three significant digits ("15.3 GiB", "122 GiB")."""
    return f"{n / GiB:.3g} GiB"


def lora_jobs_per_device(worker: WorkerPlan, job: JobShape) -> int:
    """How many LoRA jobs of ``job``'s shape fit one device at once, all resident."""
    fp = footprint(worker, job)
    room = free_bytes(worker) - fp.base
    return max(0, math.floor(room / fp.state)) if fp.state else 0
