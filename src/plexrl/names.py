"""The closed sets of names plexrl's layers share, each a ``Literal`` type (mypy checks every
comparison against it) and the tuple of its values (for validation and help texts).

Names a client sends (a placement, a worker's role, an export format) stay plain strings on the
wire and are checked where they arrive, with an error that lists the choices; past that check
they are these types.
"""

from __future__ import annotations

from typing import Literal, TypeGuard, get_args

Role = Literal["both", "rollout", "train"]  # what a worker serves: homes and their generates; pooled turns; homes only
ROLES: tuple[Role, ...] = get_args(Role)


def is_role(name: str) -> TypeGuard[Role]:
    return name in ROLES


Placement = Literal["colocated", "disaggregated", "pooled"]  # where a job's generates run
PLACEMENTS: tuple[Placement, ...] = get_args(Placement)

JobStatus = Literal["open", "closing", "suspended", "lost"]  # a job at the coordinator

Tier = Literal["device", "host", "to_device", "to_host"]  # where a job's state is on its home worker

Lane = Literal["sampler", "trainer"]  # a job's calls run in two lanes: generates, and every other kind

CallKind = Literal[
    "generate",
    "logprobs",
    "forward_backward",
    "optim_step",
    "sync_weights",
    "set_weights",
    "save",
    "load",
    "open",
    "close",
    "restore",
]
CALL_KINDS: tuple[CallKind, ...] = get_args(CallKind)

SaveFormat = Literal["plexrl", "peft", "hf"]  # a checkpoint; an adapter for other tools; a merged model
EXPORT_FORMATS: tuple[SaveFormat, ...] = ("peft", "hf")

EngineSleep = Literal["auto", "always", "never"]  # when a worker's engines sleep for its training
ENGINE_SLEEP: tuple[EngineSleep, ...] = get_args(EngineSleep)

EngineState = Literal["awake", "asleep", "to_sleep", "to_wake"]  # a worker's vLLM engines
