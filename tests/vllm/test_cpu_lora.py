"""plexrl's grouped multi-LoRA layers against vLLM's own CPU ops, on the same inputs.

``GroupedPunicaWrapperCPU.add_lora_linear`` must add what ``PunicaWrapperCPU.add_lora_linear``
adds, for decode and prefill steps, tokens spread over many adapters or piled on one, and a
single token; a token without an adapter (slot -1) must get nothing. The end-to-end check is
``test_vllm_sampler.py``: vLLM's tokens and logprobs against the hf sampler's, with these layers.
"""

from __future__ import annotations

import pytest
import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from plexrl.worker.sampler import cpu_lora

RANK, IN, SLOTS = 8, 128, 32
SLICES = (128, 64, 64)  # a merged q/k/v projection


def wrapper(cls: type, indices: torch.Tensor, prefill: bool) -> PunicaWrapperCPU:
    w = cls(4096, 256, "cpu")
    w._token_lora_indices[: len(indices)] = indices
    w.indices_len[:] = [len(indices)] * 4
    w.is_prefill = prefill
    if prefill:
        w._update_prefill_metadata(w.token_lora_indices)
    return w


def slots(case: str, tokens: int, g: torch.Generator) -> torch.Tensor:
    if case == "spread":
        return torch.randint(0, SLOTS, (tokens,), generator=g)
    if case == "few":
        return torch.randint(0, 3, (tokens,), generator=g)
    # "piled": most tokens on one adapter, one token on each of the others
    piled = torch.cat([torch.zeros(tokens - SLOTS + 1, dtype=torch.long), torch.arange(1, SLOTS)])
    return piled[torch.randperm(tokens, generator=g)]


@pytest.mark.parametrize("prefill", [False, True])
@pytest.mark.parametrize(("case", "tokens"), [("spread", 256), ("few", 64), ("piled", 300), ("spread", 1)])
def test_grouped_layers_add_what_vllm_adds(case: str, tokens: int, prefill: bool) -> None:
    g = torch.Generator().manual_seed(tokens)
    lora_a = tuple(torch.randn(SLOTS, 1, RANK, IN, generator=g) for _ in SLICES)
    lora_b = tuple(torch.randn(SLOTS, 1, out, RANK, generator=g) for out in SLICES)
    x = torch.randn(tokens, IN, generator=g)
    indices = slots(case, tokens, g)
    if prefill:  # a prefill step's tokens come sequence by sequence
        indices = torch.sort(indices).values
    y = torch.randn(tokens, sum(SLICES), generator=g)
    expected, got = y.clone(), y.clone()
    wrapper(PunicaWrapperCPU, indices, prefill).add_lora_linear(expected, x, lora_a, lora_b, 0.5, SLICES)
    wrapper(cpu_lora.GroupedPunicaWrapperCPU, indices, prefill).add_lora_linear(got, x, lora_a, lora_b, 0.5, SLICES)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_groups_pad_only_the_adapters_in_the_step_and_take_out_a_crowded_one() -> None:
    scattered = cpu_lora.TokenGroups.of(torch.tensor([0, 31, 0, 31, 31, 0]), SLOTS)
    assert scattered.width == 3 and len(scattered.source) == 6 and not scattered.big  # not 32 slots of padding
    assert scattered.small is not None and scattered.small.tolist() == [0, 31]
    busy = cpu_lora.TokenGroups.of(torch.arange(SLOTS // 2).repeat(3), SLOTS)  # half the slots: all in place
    assert busy.small is None and busy.width == 3 and len(busy.source) == SLOTS * 3
    # 200 tokens of slot 4, ten at a time (no run), between them 4 tokens each of 5 other slots
    others = [[1, 2, 3, 5, 6][i % 5] for i in range(20)]
    crowded = cpu_lora.TokenGroups.of(torch.tensor([t for o in others for t in [4] * 10 + [o]]), SLOTS)
    assert [slot for slot, _ in crowded.big] == [4] and crowded.width == 4 and not crowded.runs
    assert len(crowded.big[0][1]) == 200


def test_a_run_of_one_adapters_tokens_is_taken_whole_and_the_rest_grouped() -> None:
    run = cpu_lora.RUN_MIN + 4
    indices = torch.tensor([3, 7] + [5] * run + [3, 5] + [-1] * cpu_lora.RUN_MIN + [2] * (cpu_lora.RUN_MIN - 1))
    groups = cpu_lora.TokenGroups.of(indices, SLOTS)
    assert groups.runs == ((5, 2, 2 + run),)  # no run of no adapter, none shorter than RUN_MIN
    grouped = groups.tokens.tolist() + [t for _, tokens in groups.big for t in tokens.tolist()]
    after_run = 2 + run
    expected = [0, 1, after_run, after_run + 1, *range(after_run + 2 + cpu_lora.RUN_MIN, len(indices))]
    assert sorted(grouped) == expected  # every other token with an adapter, once


def test_adapters_of_lower_rank_than_the_slots_add_what_vllm_adds_in_a_step_of_runs_and_scattered_tokens() -> None:
    """vLLM pads each adapter to the slots' rank with zeros; runs and single adapters' matmuls
    use only the rank an adapter has."""
    g = torch.Generator().manual_seed(11)
    lora_a = tuple(torch.randn(SLOTS, 1, RANK, IN, generator=g) for _ in SLICES)
    lora_b = tuple(torch.randn(SLOTS, 1, out, RANK, generator=g) for out in SLICES)
    for slot in range(SLOTS):
        rank = (2, 4, RANK)[slot % 3]
        for a, b in zip(lora_a, lora_b, strict=True):
            a[slot, 0, rank:] = 0
            b[slot, 0, :, rank:] = 0
    scattered = lambda n: torch.randint(0, SLOTS, (n,), generator=g)  # noqa: E731
    indices = torch.cat([scattered(24), torch.full((40,), 4), scattered(8), torch.full((30,), 9), torch.full((90,), 5)])
    groups = cpu_lora.TokenGroups.of(indices, SLOTS)
    assert [slot for slot, *_ in groups.runs] == [4, 9, 5]
    x = torch.randn(len(indices), IN, generator=g)
    y = torch.randn(len(indices), sum(SLICES), generator=g)
    expected, got = y.clone(), y.clone()
    wrapper(PunicaWrapperCPU, indices, prefill=False).add_lora_linear(expected, x, lora_a, lora_b, 0.5, SLICES)
    wrapper(cpu_lora.GroupedPunicaWrapperCPU, indices, prefill=False).add_lora_linear(
        got, x, lora_a, lora_b, 0.5, SLICES
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_tokens_without_an_adapter_get_nothing() -> None:
    lora_a = tuple(torch.randn(SLOTS, 1, RANK, IN) for _ in SLICES)
    lora_b = tuple(torch.randn(SLOTS, 1, out, RANK) for out in SLICES)
    y = torch.zeros(4, sum(SLICES))
    w = wrapper(cpu_lora.GroupedPunicaWrapperCPU, torch.tensor([0, -1, 5, -1]), prefill=False)
    w.add_lora_linear(y, torch.randn(4, IN), lora_a, lora_b, 1.0, SLICES)
    assert torch.all(y[[1, 3]] == 0)
    assert torch.all(y[[0, 2]] != 0)


def test_an_adapter_with_non_finite_weights_touches_only_its_own_tokens() -> None:
    g = torch.Generator().manual_seed(3)
    lora_a = tuple(torch.randn(SLOTS, 1, RANK, IN, generator=g) for _ in SLICES)
    lora_b = tuple(torch.randn(SLOTS, 1, out, RANK, generator=g) for out in SLICES)
    for b in lora_b:
        b[3] = float("inf")
    indices = torch.tensor([0, 3, 0, 0, 5, 3, 0])  # slot 0 pads slot 3's and 5's groups
    y = torch.zeros(len(indices), sum(SLICES))
    wrapper(cpu_lora.GroupedPunicaWrapperCPU, indices, prefill=False).add_lora_linear(
        y, torch.randn(len(indices), IN, generator=g), lora_a, lora_b, 1.0, SLICES
    )
    assert torch.all(torch.isfinite(y[indices != 3]))


def test_a_slot_given_another_adapter_is_served_its_weights() -> None:
    """The layer's combined weights are kept across steps until vLLM's slots change (it calls
    ``update_metadata`` with the slots' adapter ids before a step that uses a new adapter)."""
    from vllm.lora.layers.utils import LoRAMapping

    g = torch.Generator().manual_seed(7)
    lora_a = tuple(torch.randn(SLOTS, 1, RANK, IN, generator=g) for _ in SLICES)
    lora_b = tuple(torch.randn(SLOTS, 1, out, RANK, generator=g) for out in SLICES)
    x = torch.randn(6, IN, generator=g)
    slots: list[int | None] = [None] * SLOTS
    slots[:2] = [11, 12]
    mapping = LoRAMapping(index_mapping=(11, 12, 11, 12, 11, 12), prompt_mapping=(11, 12))
    grouped, ref = cpu_lora.GroupedPunicaWrapperCPU(4096, 256, "cpu"), PunicaWrapperCPU(4096, 256, "cpu")

    def step() -> None:
        got, expected = torch.zeros(6, sum(SLICES)), torch.zeros(6, sum(SLICES))
        for w, y in ((grouped, got), (ref, expected)):
            w.update_metadata(mapping, slots, SLOTS + 1, 64)
            w.add_lora_linear(y, x, lora_a, lora_b, 1.0, SLICES)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)

    step()
    for a in lora_a:  # vLLM activates adapter 13 in slot 1 (in place), then maps tokens to it
        a[1].copy_(torch.randn(1, RANK, IN, generator=g))
    slots[1] = 13
    mapping = LoRAMapping(index_mapping=(11, 13, 11, 13, 11, 13), prompt_mapping=(11, 13))
    step()


def test_the_plugin_acts_only_when_the_worker_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "get_punica_wrapper", CpuPlatform.get_punica_wrapper)  # restored after
    monkeypatch.delenv(cpu_lora.ENV, raising=False)
    cpu_lora.register()
    assert CpuPlatform.get_punica_wrapper().endswith(".PunicaWrapperCPU")
    monkeypatch.setenv(cpu_lora.ENV, "1")
    cpu_lora.register()
    assert CpuPlatform.get_punica_wrapper() == "plexrl.worker.sampler.cpu_lora.GroupedPunicaWrapperCPU"
