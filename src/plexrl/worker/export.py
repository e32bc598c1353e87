"""A job's weights as directories other tools load: a PEFT adapter, or a merged Hugging Face model.

- ``peft``: ``adapter_model.safetensors`` (PEFT's saved layout, ``base_model.model....lora_A.weight``)
  and ``adapter_config.json``: ``peft.PeftModel.from_pretrained(base, dir)`` loads it and vLLM
  serves it as a LoRA adapter (the vLLM sampler publishes every adapter version this way).
- ``hf``: the base model with the adapter merged in (``W + (alpha / r) B A``; a full fine-tune
  job's weights as they are), its config, generation config and the base's tokenizer files:
  ``AutoModelForCausalLM.from_pretrained(dir)`` loads it and ``vllm serve dir`` serves it.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from plexrl.errors import InvalidRequestError
from plexrl.names import EXPORT_FORMATS

if TYPE_CHECKING:
    from plexrl.worker.models import BaseModel
    from plexrl.worker.trainer.job import Weights

PEFT_WEIGHTS = "adapter_model.safetensors"
# The model files an ``hf`` export writes itself; the base directory's other files (tokenizer, ...) are copied.
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")


def write_peft_adapter(
    path: Path, tensors: dict[str, Tensor], peft_config: Any, dtype: torch.dtype = torch.float32
) -> None:
    """A PEFT adapter directory at ``path`` (which exists) from tensors in PEFT's saved layout,
    stored in ``dtype``."""
    save_file({k: t.detach().to("cpu", dtype).contiguous() for k, t in tensors.items()}, path / PEFT_WEIGHTS)
    peft_config.save_pretrained(str(path))


def write(path: Path, fmt: str, base: BaseModel, weights: Weights, trained: dict[str, Tensor]) -> None:
    """Export the trainer's weights ``trained`` (``weights``' trainer parameters, whole) in ``fmt``
    into the existing empty directory ``path``."""
    if fmt == "peft":
        if weights.kind != "lora":
            raise InvalidRequestError("a full fine-tune job has no adapter to export: use format='hf'")
        write_peft_adapter(path, trained, weights.adapter_config())
    elif fmt == "hf":
        merged(base, weights, trained).save_pretrained(str(path), safe_serialization=True)
        for f in Path(base.path).iterdir():
            if f.is_file() and f.name not in MODEL_FILES and not f.name.endswith((".safetensors", ".bin", ".md")):
                shutil.copy2(f, path / f.name)
    else:
        raise InvalidRequestError(f"export format {fmt!r}: choose one of {', '.join(EXPORT_FORMATS)}")


@torch.no_grad()
def merged(base: BaseModel, weights: Weights, trained: dict[str, Tensor]) -> Any:
    """A copy of the base model in host memory, in its stored dtype, with the job's trainer weights
    in it: a LoRA job's ``W + scale * B A`` is taken one layer at a time in float32 and rounded
    once, so nothing but the export's own copy is ever made (none on the device)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(base.model.config, dtype=base.dtype)
    model.generation_config = base.model.generation_config
    params = model.state_dict()  # tied weights under both names, one storage
    for name, tensor in base.weights.items():
        params[name].copy_(tensor.to("cpu"))
    if weights.kind == "full":  # its own weights over the base's (a tied output layer with its embedding)
        for name, tensor in trained.items():
            params[name].copy_(tensor.to("cpu"))
        return model
    config = weights.adapter_config()
    scale = config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)
    for name, a in trained.items():
        if ".lora_A." not in name:
            continue
        b = trained[name.replace(".lora_A.", ".lora_B.")]
        layer = params[f"{name.removeprefix('base_model.model.').split('.lora_A.')[0]}.weight"]
        delta = scale * (b.to("cpu", torch.float32) @ a.to("cpu", torch.float32))
        layer.copy_(layer.float() + delta)
    return model
