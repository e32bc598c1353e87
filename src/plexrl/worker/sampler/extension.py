"""What plexrl adds inside vLLM's worker: weights handed over in memory, never as files.

A full fine-tune job's weights go to its engine in buckets of safetensors bytes and through
vLLM's in-place reload (``WorkerExtension.plexrl_reload_weights``; plain ``load_weights`` is not
enough on CPU, whose kernels use copies prepacked at load time).

The sampler stages an adapter version's weights (a safetensors blob and its PEFT config) in the
process that runs the model, ``collective_rpc("plexrl_stage_adapter", args=...)`` (a method of
``WorkerExtension``, which vLLM mixes into its worker class: ``worker_extension_cls``), then adds
it with a ``LoRARequest`` whose path is ``plexrl-memory://<name>``. vLLM's own LoRA manager
loads it as it loads any adapter, except where it would read a directory: ``register`` (a vLLM
plugin, run in every vLLM process) makes it build such an adapter from the staged tensors
(``LoRAModel.from_lora_tensors``). verl and SkyRL load adapters from tensors the same way
(``shared/research/engines.md``). The same calls run the in-process engine on CPU and an engine
process on a GPU: a blob of bytes crosses vLLM's msgpack hop where tensors would not.
"""

from __future__ import annotations

from typing import Any

SCHEME = "plexrl-memory://"
_staged: dict[int, tuple[bytes, dict[str, Any]]] = {}  # lora id -> (safetensors blob, PEFT config)
_vllms_own: Any = None  # WorkerLoRAManager._load_adapter before ``register`` wrapped it


class WorkerExtension:
    """Methods vLLM mixes into its worker (``worker_extension_cls``), called by ``collective_rpc``."""

    def plexrl_stage_adapter(self, lora_id: int, tensors: bytes, config: dict[str, Any]) -> None:
        """Keep adapter ``lora_id``'s weights for vLLM to load (an ``add_lora`` of its memory path),
        until ``plexrl_unstage_adapter``: a reload of the base weights (a refit, a wake from a
        level-2 sleep) drops every adapter vLLM holds, and it loads them again on their next use."""
        _staged[lora_id] = (tensors, config)

    def plexrl_unstage_adapter(self, lora_id: int) -> None:
        _staged.pop(lora_id, None)

    def plexrl_reload_weights(self, buckets: list[bytes]) -> None:
        """Replace the model's weights with those in ``buckets`` (safetensors blobs of a transformers
        state dict), read one bucket at a time, through vLLM's layer-wise in-place reload."""
        from safetensors.torch import load

        tensors = (item for bucket in buckets for item in load(bucket).items())
        self.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)  # type: ignore[attr-defined]


def register() -> None:
    """vLLM plugin entry point: adapters whose path is ``plexrl-memory://...`` load from what was
    staged for their id; any other path loads as vLLM loads it."""
    global _vllms_own
    from vllm.lora.worker_manager import WorkerLoRAManager

    if _vllms_own is None:
        _vllms_own = WorkerLoRAManager._load_adapter
        WorkerLoRAManager._load_adapter = _load_adapter  # type: ignore[method-assign,unused-ignore]  # vLLM typed only where installed


def _load_adapter(manager: Any, request: Any) -> Any:
    if not str(request.lora_path).startswith(SCHEME):
        return _vllms_own(manager, request)
    from safetensors.torch import load
    from vllm.lora.peft_helper import PEFTHelper

    staged = _staged.get(request.lora_int_id)
    if staged is None:
        raise RuntimeError(f"adapter {request.lora_name} (id {request.lora_int_id}) was not staged in this process")
    tensors, config = staged
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)  # rank and features, as for an adapter read from files
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    return manager._lora_model_cls.from_lora_tensors(
        lora_model_id=request.lora_int_id,
        tensors=load(tensors),
        peft_helper=helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
