"""Tinker's wire types to plexrl's and back: datums to a training ``Batch``, a forward_backward's
result and a sample's completions to the protobuf bodies the SDK reads.

Tinker trains on datums: ``model_input`` tokens and, per input position, the token it predicts
(``target_tokens``) with its loss inputs (``weights``, ``advantages``, ``logprobs``). plexrl's
trainer takes whole sequences whose completion tokens are the targets, so a datum becomes the
row ``model_input + [target_tokens[-1]]`` with a one-token prompt, which holds exactly when the
targets are the inputs shifted by one (every recipe's datums are); other datums get a typed error.
Tinker's losses are token-wise sums: ``cross_entropy`` is ``-sum(weights * logprob)``,
``importance_sampling`` ``-sum(ratio * advantages)``, ``ppo`` the clipped version (plexrl's
``grpo`` loss with per-token advantages), and the optimizer steps on the summed gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from plexrl.errors import BatchShapeError, InvalidRequestError
from plexrl.protocol import calls
from plexrl.types import Batch, LossConfig, Ragged

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
LOSSES = {"cross_entropy": "cross_entropy", "importance_sampling": "importance_sampling", "ppo": "grpo"}


@dataclass(frozen=True)
class Training:
    """A forward_backward request as plexrl runs it."""

    batch: Batch
    loss: str
    config: LossConfig
    forward_only: bool
    lengths: list[int]  # each datum's target count (its logprobs come back in that many)


def tensor(t: pb.Tensor, name: str) -> np.ndarray:
    """A loss input as a flat array (dense, or sparse CSR with zeros elsewhere)."""
    dtype = _NUMPY.get(t.dtype)
    if dtype is None:
        raise BatchShapeError(f"loss input {name!r} has an unsupported dtype ({t.dtype}): send float32 or int64")
    shape = list(t.shape)
    if t.HasField("sparse_csr"):
        rows, cols = (1, shape[0]) if len(shape) == 1 else (shape[0], int(np.prod(shape[1:])))
        dense = np.zeros((rows, cols), dtype)
        crow = np.frombuffer(t.sparse_csr.crow_indices, np.int64)
        col = np.frombuffer(t.sparse_csr.col_indices, np.int64)
        values = np.frombuffer(t.sparse_csr.values, dtype)
        for r in range(rows):
            dense[r, col[crow[r] : crow[r + 1]]] = values[crow[r] : crow[r + 1]]
        return dense.reshape(-1)
    return np.frombuffer(t.dense, dtype).copy()


def model_input_tokens(chunks: Any) -> np.ndarray:
    """The token ids of a ``ModelInput`` (protobuf chunks, or the JSON form's dicts)."""
    parts: list[np.ndarray] = []
    for chunk in chunks:
        if isinstance(chunk, dict):
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise InvalidRequestError(f"plexrl takes text chunks only, not {chunk.get('type')!r} chunks")
            parts.append(np.asarray(chunk["tokens"], np.int32))
        elif chunk.WhichOneof("chunk") == "encoded_text":
            parts.append(np.frombuffer(chunk.encoded_text.tokens, np.int32))
        else:
            raise InvalidRequestError(f"plexrl takes text chunks only, not {chunk.WhichOneof('chunk')} chunks")
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def training(request: pb.ForwardBackwardRequest) -> Training:
    """The plexrl batch, loss and config of a forward_backward request."""
    loss = LOSSES.get(request.loss_fn)
    if loss is None:
        raise InvalidRequestError(
            f"loss_fn {request.loss_fn!r} is not supported by plexrl's gateway: use one of {', '.join(LOSSES)}"
        )
    if not request.data:
        raise BatchShapeError("forward_backward needs at least one datum")
    rows: list[np.ndarray] = []
    weights: list[np.ndarray] = []
    advantages: list[np.ndarray] = []
    logprobs: list[np.ndarray] = []
    lengths: list[int] = []
    for i, datum in enumerate(request.data):
        tokens = model_input_tokens(datum.model_input)
        inputs = {k: tensor(v, k) for k, v in datum.loss_fn_inputs.items()}
        if "target_tokens" not in inputs:
            raise BatchShapeError(f"datum {i} has no target_tokens")
        targets = inputs["target_tokens"].astype(np.int64)
        n = len(tokens)
        if n == 0 or len(targets) != n or np.any(targets[:-1] != tokens[1:]):
            raise BatchShapeError(
                f"datum {i}: plexrl trains on target_tokens that are model_input shifted by one "
                "(target_tokens[t] == model_input[t + 1]), one per input token"
            )
        rows.append(np.concatenate([tokens, targets[-1:].astype(np.int32)]))
        lengths.append(n)
        for name, into, default in (("weights", weights, 1.0), ("advantages", advantages, 0.0),
                                    ("logprobs", logprobs, 0.0)):  # fmt: skip
            value = inputs.get(name)
            if value is not None and len(value) != n:
                raise BatchShapeError(f"datum {i}: {name} has {len(value)} values for {n} target tokens")
            into.append(np.full(n, default, np.float32) if value is None else value.astype(np.float32))
    config = LossConfig()
    if request.loss_fn == "ppo":
        low, high = (
            _config_number(request, "clip_low_threshold", 0.8),
            _config_number(request, "clip_high_threshold", 1.2),
        )
        config = LossConfig(clip_low=1.0 - low, clip_high=high - 1.0)
    batch = Batch(tokens=Ragged.from_rows(rows, "int32"), prompt_lens_B=np.ones(len(rows), np.int32))
    if loss == "cross_entropy":
        batch = msgspec.structs.replace(batch, token_weights=Ragged.from_rows(weights, "float32"))
    else:
        batch = msgspec.structs.replace(batch, token_advantages=Ragged.from_rows(advantages, "float32"),
                                        sampler_logprobs=Ragged.from_rows(logprobs, "float32"))  # fmt: skip
    return Training(batch, loss, config, request.forward_only, lengths)


def _config_number(request: pb.ForwardBackwardRequest, key: str, default: float) -> float:
    if key in request.loss_fn_config_v2:
        return float(request.loss_fn_config_v2[key].number)
    return float(request.loss_fn_config.get(key, default))


def forward_backward_output(result: calls.ForwardBackwardResult) -> bytes:
    """The SDK's ``ForwardBackwardOutput``: each datum's target logprobs, and the loss as ``loss:sum``."""
    assert result.logprobs is not None, "the gateway asks the trainer for logprobs"
    values = result.logprobs.values.astype(np.float32)
    record = pb.ArrayRecord(num_datums=len(result.logprobs))
    record.fields["logprobs"].CopyFrom(pb.BatchedTensor(
        data=values.tobytes(), offsets=(result.logprobs.offsets * 4).astype(np.int64).tobytes(), dtype=pb.DTYPE_FLOAT32,
    ))  # fmt: skip
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    out.metrics["loss:sum"] = result.loss_sum
    for key, value in result.metrics.items():
        out.metrics[f"{key}:mean"] = value
    return out.SerializeToString()


def sample_response(sequences: list[tuple[np.ndarray, np.ndarray, str]], prompt_logprobs: np.ndarray | None) -> bytes:
    """The SDK's ``SampleResponse``: each completion's tokens, logprobs and stop reason ("stop" or
    "length"), and the prompt's logprobs (NaN for its first token) when asked for."""
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    out = pb.SampleResponse(sequences=[
        pb.SampledSequence(stop_reason=reasons[reason], tokens=tokens.astype(np.int32).tobytes(),
                           logprobs=logprobs.astype(np.float32).tobytes())
        for tokens, logprobs, reason in sequences
    ])  # fmt: skip
    if prompt_logprobs is not None:
        out.prompt_logprobs = prompt_logprobs.astype(np.float32).tobytes()
    return out.SerializeToString()
