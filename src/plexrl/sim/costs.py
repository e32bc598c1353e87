"""Cost models of LoRA GRPO jobs on a datacenter GPU, from the roofline (for ``plexrl.sim``).

Decode is memory-bound: a decode step reads the base weights once (shared by every same-base
sequence batched with it: multi-LoRA sampling) plus the KV cache of the sequences still
decoding. Training is compute-bound: ``6 * params`` FLOPs per token (forward, backward through
the activations, and the recomputed forward of activation checkpointing) at a stated MFU.
Between calls a LoRA job's state is its adapter, its gradients and two AdamW moments (fp32);
the KV cache lives only while a generate call runs. Every efficiency below is an assumption,
stated here; ``bench/multiplex.py`` checks the simulator against the real worker on this
machine's workload before using these models (docs/architecture.md, "Calibration").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from plexrl.sim.workload import JobModel, Lognormal


@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_bytes_per_s: float
    bf16_flops: float  # dense
    memory_bytes: float
    host_bytes_per_s: float  # pinned host <-> device copies
    decode_efficiency: float = 0.6  # achieved fraction of HBM bandwidth while decoding
    train_mfu: float = 0.4  # achieved fraction of bf16 FLOPs while training
    link_bytes_per_s: float = 450e9  # to another GPU of its node, one direction (NVLink 4: 900 GB/s both ways)
    link_efficiency: float = 0.8  # achieved fraction of it by ring all-gather / reduce-scatter (NCCL, large messages)


# H200 SXM spec sheet: 4.8 TB/s HBM3e, 989 TFLOPS dense bf16, 141 GB; NVLink 4, 900 GB/s per GPU.
H200 = Gpu("H200", hbm_bytes_per_s=4.8e12, bf16_flops=989e12, memory_bytes=141e9, host_bytes_per_s=50e9)


@dataclass(frozen=True)
class Llm:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int

    @property
    def weight_bytes(self) -> float:
        return 2 * self.params  # bf16

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16

    def lora_params(self, rank: int) -> float:
        """A rank-``rank`` adapter on every linear layer (attention q, k, v, o and the MLP)."""
        q = self.hidden
        kv = self.kv_heads * self.head_dim
        dims = [
            (q, q),
            (q, kv),
            (q, kv),
            (q, q),
            (q, self.intermediate),
            (q, self.intermediate),
            (self.intermediate, q),
        ]
        return self.layers * rank * sum(a + b for a, b in dims)


# Qwen3 dense models' shapes (their published configs).
QWEN3 = {
    "1.7B": Llm("qwen3-1.7b", 1.7e9, layers=28, kv_heads=8, head_dim=128, hidden=2048, intermediate=6144),
    "4B": Llm("qwen3-4b", 4.0e9, layers=36, kv_heads=8, head_dim=128, hidden=2560, intermediate=9728),
    "8B": Llm("qwen3-8b", 8.2e9, layers=36, kv_heads=8, head_dim=128, hidden=4096, intermediate=12288),
    "14B": Llm("qwen3-14b", 14.8e9, layers=40, kv_heads=8, head_dim=128, hidden=5120, intermediate=17408),
    "32B": Llm("qwen3-32b", 32.8e9, layers=64, kv_heads=8, head_dim=128, hidden=5120, intermediate=25600),
}


AGENT_OUTPUT_TOKENS = Lognormal(400.0, 0.9)  # per turn: median 400 tokens, p99 ~3,200
AGENT_TOOL_LATENCY_S = Lognormal(8.0, 1.0)  # code runs and searches: median 8 s, p99 ~80 s


def active_fraction(output_tokens: Lognormal, rollouts: int) -> float:
    """Of a generate call's decode steps, the mean fraction of its sequences still decoding:
    mean length over the expected longest one (the long tail leaves the batch mostly empty)."""
    mean = output_tokens.median * math.exp(output_tokens.sigma**2 / 2)
    z = math.sqrt(2 * math.log(rollouts)) if rollouts > 1 else 0.0  # ~ the max of ``rollouts`` normals
    longest = output_tokens.median * math.exp(output_tokens.sigma * z)
    return min(1.0, mean / longest)


def grpo_job(
    name: str,
    llm: Llm,
    gpu: Gpu = H200,
    *,
    steps: int = 20,
    rollouts: int = 64,
    turns: int = 3,
    prompt_tokens: int = 1024,
    output_tokens: Lognormal = AGENT_OUTPUT_TOKENS,
    tool_latency_s: Lognormal = AGENT_TOOL_LATENCY_S,
    lora_rank: int = 64,
    arrival_s: float = 0.0,
) -> JobModel:
    """An agentic LoRA GRPO job on ``llm``: ``turns`` generate + tool rounds per step."""
    mean_out = output_tokens.median * math.exp(output_tokens.sigma**2 / 2)
    context = prompt_tokens + mean_out * turns / 2  # mean context while decoding, over the turns
    kv_step = active_fraction(output_tokens, rollouts) * rollouts * context * llm.kv_bytes_per_token
    bandwidth = gpu.hbm_bytes_per_s * gpu.decode_efficiency
    decode_step_s = (llm.weight_bytes + kv_step) / bandwidth
    return JobModel(
        name=name,
        steps=steps,
        rollouts=rollouts,
        turns=turns,
        output_tokens=output_tokens,
        decode_step_s=decode_step_s,
        shared_step_fraction=llm.weight_bytes / (llm.weight_bytes + kv_step),
        tool_latency_s=tool_latency_s,
        arrival_s=arrival_s,
        **_lora_training(llm, gpu, lora_rank),
    )


def _lora_training(llm: Llm, gpu: Gpu, lora_rank: int) -> dict[str, Any]:
    """What a LoRA job's training costs, and the state it keeps between calls."""
    bandwidth = gpu.hbm_bytes_per_s * gpu.decode_efficiency
    return {
        "train_s_per_token": 6 * llm.params / (gpu.bf16_flops * gpu.train_mfu),
        "optim_step_s": 16 * llm.lora_params(lora_rank) / bandwidth,  # AdamW: read/write fp32 state
        "sync_s": 4 * llm.lora_params(lora_rank) / bandwidth,  # adapter copy into the sampler
        "state_bytes": int(16 * llm.lora_params(lora_rank)),  # fp32 adapter, gradients, two moments
        "grad_bytes": int(4 * llm.lora_params(lora_rank)),  # fp32 gradients
        "base": llm.name,
    }


def pooled_agent_job(
    name: str,
    llm: Llm,
    gpu: Gpu = H200,
    *,
    steps: int = 10,
    rollouts: int = 64,
    turns: int = 3,
    prompt_tokens: int = 1024,
    observation_tokens: int = 256,
    output_tokens: Lognormal = AGENT_OUTPUT_TOKENS,
    tool_latency_s: Lognormal = AGENT_TOOL_LATENCY_S,
    tool_error_p: float = 0.0,
    difficulty_sigma: float = 0.0,
    lora_rank: int = 64,
    arrival_s: float = 0.0,
) -> JobModel:
    """An agentic LoRA GRPO job whose trajectories are scheduled turn by turn (a pooled job): a
    turn's decode step reads the base weights (shared by every turn batched with it), its own KV
    cache (its context so far) and does its share of the matmuls (``2 * params`` FLOPs a token,
    at the training MFU: batched decode is far from peak, so this is generous to big batches)."""
    bandwidth = gpu.hbm_bytes_per_s * gpu.decode_efficiency
    weights_s = llm.weight_bytes / bandwidth
    flops_s = 2 * llm.params / (gpu.bf16_flops * gpu.train_mfu)
    return JobModel(
        name=name,
        steps=steps,
        rollouts=rollouts,
        turns=turns,
        output_tokens=output_tokens,
        decode_step_s=weights_s + flops_s,
        shared_step_fraction=weights_s / (weights_s + flops_s),
        kv_step_s_per_token=llm.kv_bytes_per_token / bandwidth,
        prompt_tokens=prompt_tokens,
        observation_tokens=observation_tokens,
        tool_latency_s=tool_latency_s,
        tool_error_p=tool_error_p,
        difficulty_sigma=difficulty_sigma,
        arrival_s=arrival_s,
        pooled=True,
        **_lora_training(llm, gpu, lora_rank),
    )


ALL_REDUCE_S = 10e-6  # one small all-reduce over NVLink (decode activations): latency-bound


def tp_comm_s(llm: Llm, tp: int, all_reduce_s: float = ALL_REDUCE_S) -> float:
    """What tensor parallelism adds to a decode round: two all-reduces per layer (attention, MLP)."""
    return 0.0 if tp <= 1 else 2 * llm.layers * all_reduce_s


# -- jobs on a worker group: an FSDP2 trainer and a tensor-parallel sampler over ``devices`` GPUs --

FULL_STATE_BYTES_PER_PARAM = (
    18  # bf16 weights (trainer) + fp32 master + two fp32 AdamW moments + bf16 grads + bf16 sampler copy
)
MICROBATCH_TOKENS = 16384  # tokens per FSDP forward/backward pass: each pass gathers every layer's weights again


def ring_s(payload_bytes: float, devices: int, gpu: Gpu = H200) -> float:
    """One ring all-gather or reduce-scatter of ``payload_bytes`` (the full tensor) over a node's
    links: each device sends and receives ``(k - 1) / k`` of it."""
    if devices <= 1:
        return 0.0
    return payload_bytes * (devices - 1) / devices / (gpu.link_bytes_per_s * gpu.link_efficiency)


def data_parallel_s(kind: str, seconds: float, grad_bytes: float, members: int, gpu: Gpu = H200) -> float:
    """A call of a one-device job whose training ``members`` workers share (rollout workers joined
    it: ``scheduler/elastic.py``), ``seconds`` alone: a forward_backward's rows split evenly; an
    optim_step after a ring all-reduce of the gradients (a reduce-scatter and an all-gather); the
    rest as on one."""
    if members <= 1:
        return seconds
    if kind == "forward_backward":
        return seconds / members
    if kind == "optim_step":
        return seconds + 2 * ring_s(grad_bytes, members, gpu)
    return seconds


def group_costs(llm: Llm, devices: int, gpu: Gpu = H200, *, rollouts: int = 64, context: float = 2048.0,
                active: float = 1.0) -> dict[str, float]:  # fmt: skip
    """What a full fine-tune of ``llm`` costs per call on ``devices`` GPUs of one node.

    Sampler, tensor-parallel of degree ``devices``: a decode step reads ``1/k`` of the weights and of
    the KV cache on each GPU, plus two all-reduces of the batch's activations per layer (attention
    and MLP outputs: latency-bound, ``tp_comm_s``, plus their bytes over the links). Trainer, FSDP2
    over ``devices`` (ZeRO-3: parameters, gradients and optimizer state sharded): ``1/k`` of the
    FLOPs per GPU, plus per micro-batch of ``MICROBATCH_TOKENS`` an all-gather of every layer's
    weights in the forward, another in the backward (``reshard_after_forward``) and a
    reduce-scatter of the gradients, counted in full (no overlap with compute: an upper bound).
    Weight sync gathers each layer to full tensors and keeps this GPU's TP slice (a ring
    all-gather of the weights plus a copy of ``1/k`` of them). ``state_bytes`` is each GPU's shard.
    """
    k = devices
    bandwidth = gpu.hbm_bytes_per_s * gpu.decode_efficiency
    kv_step = active * rollouts * context * llm.kv_bytes_per_token
    activations = active * rollouts * llm.hidden * 2  # one all-reduce's bf16 payload
    all_reduces = 2 * llm.layers * 2 * ring_s(activations, k, gpu)  # reduce-scatter + all-gather each
    decode_step_s = (llm.weight_bytes + kv_step) / k / bandwidth + tp_comm_s(llm, k) + all_reduces
    gathers_per_token = ring_s(3 * llm.weight_bytes, k, gpu) / MICROBATCH_TOKENS  # 2 gathers + 1 reduce-scatter
    return {
        "decode_step_s": decode_step_s,
        "shared_step_fraction": 0.0,  # a full fine-tune's weights are its own: nothing to batch with
        "train_s_per_token": 6 * llm.params / (k * gpu.bf16_flops * gpu.train_mfu) + gathers_per_token,
        "optim_step_s": 16 * llm.params / k / bandwidth,  # AdamW over the shard: fp32 state read and written
        "sync_s": ring_s(llm.weight_bytes, k, gpu) + llm.weight_bytes / k / bandwidth,
        "state_bytes": FULL_STATE_BYTES_PER_PARAM * llm.params / k,
    }


def group_job(
    name: str,
    llm: Llm,
    devices: int,
    gpu: Gpu = H200,
    *,
    steps: int = 20,
    rollouts: int = 64,
    turns: int = 3,
    prompt_tokens: int = 1024,
    output_tokens: Lognormal = AGENT_OUTPUT_TOKENS,
    tool_latency_s: Lognormal = AGENT_TOOL_LATENCY_S,
    arrival_s: float = 0.0,
) -> JobModel:
    """An agentic full fine-tune GRPO job of ``llm`` on a group of ``devices`` GPUs (``group_costs``)."""
    mean_out = output_tokens.median * math.exp(output_tokens.sigma**2 / 2)
    costs = group_costs(llm, devices, gpu, rollouts=rollouts, context=prompt_tokens + mean_out * turns / 2,
                        active=active_fraction(output_tokens, rollouts))  # fmt: skip
    return JobModel(
        name=name,
        steps=steps,
        rollouts=rollouts,
        turns=turns,
        output_tokens=output_tokens,
        decode_step_s=costs["decode_step_s"],
        shared_step_fraction=costs["shared_step_fraction"],
        tool_latency_s=tool_latency_s,
        train_s_per_token=costs["train_s_per_token"],
        optim_step_s=costs["optim_step_s"],
        sync_s=costs["sync_s"],
        state_bytes=int(costs["state_bytes"]),
        arrival_s=arrival_s,
        devices=devices,
    )
