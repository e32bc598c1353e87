"""Weights for vLLM in memory: a full model's refit in safetensors buckets of bounded size."""

from __future__ import annotations

import torch
from safetensors.torch import load

from plexrl.worker.sampler.vllm import _buckets


def test_refit_buckets_hold_every_tensor_once_in_the_engines_dtype_and_stay_under_their_bound() -> None:
    tensors = {f"layer{i}.weight": torch.full((64, 64), float(i)) for i in range(10)}  # 8 KiB each in bf16
    tensors["huge.weight"] = torch.ones(256, 256)  # 128 KiB: over the bound, alone in its bucket
    buckets = _buckets(tensors, torch.bfloat16, max_bytes=20 << 10)
    loaded = [load(b) for b in buckets]
    assert sorted(k for part in loaded for k in part) == sorted(tensors)
    for part in loaded:
        assert {t.dtype for t in part.values()} == {torch.bfloat16}
        assert len(part) == 1 or sum(t.numel() * 2 for t in part.values()) <= 20 << 10
        for name, t in part.items():
            torch.testing.assert_close(t.float(), tensors[name])
    assert len(buckets) == 6  # 2 + 2 + 2 + 2 + 2 of the small ones, then the huge one
