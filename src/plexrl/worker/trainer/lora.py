"""LoRA weights of one job: its adapters on the base model's shared peft ``PeftModel``.

Every LoRA job on a base shares one ``PeftModel`` wrapping it (``BaseModel.adapters``). A job
owns a trainer adapter, the one its optimizer updates, and (with the hf sampler) a sampler
adapter, what ``generate`` runs and what ``sync_weights`` copies the trainer into; with vLLM the
engine holds the sampled adapter and peft holds none (each peft adapter makes adding the next
one slower: peft walks every adapter's modules). Only the active adapter takes part in a forward
pass, so a backward pass can only put gradients on the active job's trainer adapter; other
jobs' accumulated gradients sit untouched on their own parameters.
"""

from __future__ import annotations

from typing import Any

from peft import LoraConfig, get_peft_model
from torch import nn

from plexrl.errors import InvalidRequestError
from plexrl.types import LoRA
from plexrl.worker.models import BaseModel, seeded


class LoraWeights:
    kind = "lora"
    sharded = False  # a LoRA job on a gang is data parallel: each member holds the whole adapter

    def __init__(self, base: BaseModel, lora: LoRA, seed: int, sampler_copy: bool = True) -> None:
        _check_targets(base, lora)
        config = LoraConfig(
            r=lora.rank,
            lora_alpha=2 * lora.rank if lora.alpha is None else lora.alpha,  # type: ignore[arg-type]  # a float works
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        self.base = base
        self.trainer_name, sampler_name = _free_names(base.adapters)
        self.sampler_name: str | None = sampler_name if sampler_copy else None
        device = next(iter(base.weights.values())).device
        # Seeded so a job's initial adapter depends on its spec only, not on the other jobs.
        with seeded(seed, device):
            if base.adapters is None:
                base.adapters = get_peft_model(base.model, config, adapter_name=self.trainer_name)
            else:
                base.adapters.add_adapter(self.trainer_name, config)
            if self.sampler_name is not None:
                base.adapters.add_adapter(self.sampler_name, config)
        self.trainer_params: dict[str, nn.Parameter] = _adapter_params(self.host, self.trainer_name)
        self.sampler_params: dict[str, nn.Parameter] = (
            {} if self.sampler_name is None else _adapter_params(self.host, self.sampler_name)
        )
        self.total_params = base.num_params + sum(p.numel() for p in self.trainer_params.values())

    @property
    def host(self) -> Any:
        return self.base.adapters

    def trainer_model(self, train: bool) -> nn.Module:
        """The shared model with this job's trainer adapter active (and trainable)."""
        self.host.set_adapter(self.trainer_name)
        return self.host.train(train)

    def sampler_model(self) -> nn.Module:
        if self.sampler_name is None:
            raise RuntimeError("this job samples on vLLM: it has no hf sampler adapter")
        self.host.set_adapter(self.sampler_name, inference_mode=True)
        return self.host.eval()

    def adapter_config(self) -> Any:
        return self.host.peft_config[self.trainer_name]

    def close(self) -> None:
        host = self.host
        mine = [a for a in (self.trainer_name, self.sampler_name) if a is not None]
        others = [a for a in host.peft_config if a not in mine]
        # peft warns when the active adapter is deleted, so another one is made active first.
        if others:
            host.set_adapter(others[0], inference_mode=True)
            for name in mine:
                host.delete_adapter(name)
        else:
            # Back to the plain base: with no adapter left, peft's disable_adapter() would fail.
            host.set_adapter(self.trainer_name)
            if self.sampler_name is not None:
                host.delete_adapter(self.sampler_name)
            host.unload()
            self.base.adapters = None
        self.trainer_params = {}
        self.sampler_params = {}


def _check_targets(base: BaseModel, lora: LoRA) -> None:
    problems = []
    if lora.rank < 1:
        problems.append(f"rank={lora.rank} must be >= 1")
    if lora.alpha is not None and not lora.alpha > 0:
        problems.append(f"alpha={lora.alpha} must be > 0 (or None for 2 * rank)")
    if not 0.0 <= lora.dropout < 1.0:
        problems.append(f"dropout={lora.dropout} must be in [0, 1)")
    missing = [t for t in lora.target_modules if t not in base.linear_names]
    if not lora.target_modules or missing:
        problems.append(
            f"target_modules {list(lora.target_modules)} must be a non-empty subset of the model's "
            f"linear layers {sorted(base.linear_names)}"
        )
    if problems:
        raise InvalidRequestError("invalid LoRA: " + "; ".join(problems))


def _free_names(host: Any) -> tuple[str, str]:
    # Adapter names key peft's ModuleDicts, so they cannot be job ids (which may hold dots).
    taken = set() if host is None else set(host.peft_config)
    k = 0
    while f"job{k}" in taken or f"job{k}__s" in taken:
        k += 1
    return f"job{k}", f"job{k}__s"


def _adapter_params(host: Any, adapter: str) -> dict[str, nn.Parameter]:
    """The adapter's parameters keyed by name with the adapter name cut out (same for both adapters)."""
    tag = f".{adapter}."
    return {name.replace(tag, "."): p for name, p in host.named_parameters() if tag in name}
