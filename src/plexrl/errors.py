"""Typed errors: every failure a user can see, each saying what to fix.

Errors cross process boundaries as ``ErrorInfo(code, message)`` and are rebuilt on the other
side with :func:`from_wire`, so a worker's ``BatchShapeError`` reaches the user's script as a
``BatchShapeError``. "A call failed" (:class:`CallFailedError`, the job is still usable) is
distinct from "a process is gone" (:class:`WorkerLostError`, :class:`CoordinatorLostError`).
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "BatchShapeError",
    "CallAbortedError",
    "CallFailedError",
    "CallTimeoutError",
    "CheckpointPathError",
    "CoordinatorLostError",
    "GangBrokenError",
    "InvalidSamplingParamsError",
    "JobClosedError",
    "JobSuspendedError",
    "LocalClusterError",
    "MalformedMessageError",
    "MessageTooLargeError",
    "ModelNotFoundError",
    "NoJobContextError",
    "NoWorkersError",
    "NotAuthorizedError",
    "NotJobOwnerError",
    "PlexError",
    "ProtocolVersionError",
    "ResultLostError",
    "SamplerUnavailableError",
    "StaleSamplesError",
    "TooManyCallsError",
    "TokenizerError",
    "TrajectoryError",
    "UnknownClientError",
    "UnknownJobError",
    "WorkerLostError",
    "from_wire",
]


class PlexError(Exception):
    """Base of every plexrl error; ``code`` is its stable wire name."""

    code: ClassVar[str] = "plex_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# -- bad input: the caller must change something ---------------------------------------------


class InvalidRequestError(PlexError, ValueError):
    code = "invalid_request"


class MalformedMessageError(InvalidRequestError):
    code = "malformed_message"


class MessageTooLargeError(InvalidRequestError):
    code = "message_too_large"


class ProtocolVersionError(InvalidRequestError):
    code = "protocol_version"


class ModelNotFoundError(InvalidRequestError):
    code = "model_not_found"


class UnknownJobError(InvalidRequestError, KeyError):
    code = "unknown_job"

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class JobClosedError(InvalidRequestError):
    code = "job_closed"


class JobSuspendedError(InvalidRequestError):
    """The job's client went away; the job waits (its grace period) for ``client.reattach(name)``."""

    code = "job_suspended"


class NotJobOwnerError(InvalidRequestError, PermissionError):
    code = "not_job_owner"


class InvalidSamplingParamsError(InvalidRequestError):
    code = "invalid_sampling_params"


class BatchShapeError(InvalidRequestError):
    code = "batch_shape"


class StaleSamplesError(InvalidRequestError):
    """A batch holds samples made by other weights than the trainer's current version: training on
    them would be off-policy. Sample with the current weights (after ``sync_weights``)."""

    code = "stale_samples"


class TrajectoryError(InvalidRequestError):
    """A trajectory was used out of order: an observation before its first turn, a turn of
    ``n != 1``, or an observation on a trajectory that already stopped."""

    code = "trajectory"


class TokenizerError(InvalidRequestError):
    """A tokenizer cannot do what was asked: a chat conversation without a chat template, a
    template whose next turn does not extend the tokens already sampled, stop strings on a
    model directory without tokenizer files."""

    code = "tokenizer"


class CheckpointPathError(InvalidRequestError):
    """A checkpoint path outside the job's tenant folder (absolute, or climbing out with '..')."""

    code = "checkpoint_path"


class NotAuthorizedError(PlexError, PermissionError):
    """The connection's key may not do this (a client key registering a worker, a worker key
    opening jobs): use a key of the right role (``plexrl keys add DIR NAME --role ...``)."""

    code = "not_authorized"


class TooManyCallsError(InvalidRequestError):
    """A tenant has as many calls (or bytes of them) queued or running as the coordinator allows
    (``--max-calls-per-tenant``, ``--max-bytes-per-tenant``)."""

    code = "too_many_calls"


class NoJobContextError(PlexError, RuntimeError):
    """A module-level call (``plexrl.generate``) made outside ``async with plexrl.job(...)``."""

    code = "no_job_context"


# -- the service cannot do it right now ------------------------------------------------------


class NoWorkersError(PlexError):
    code = "no_workers"


class JobTooLargeError(NoWorkersError):
    """No worker's device can hold the job even alone, by the memory plan; the message names the numbers."""

    code = "job_too_large"


class CallFailedError(PlexError, RuntimeError):
    """The engine raised while executing the call; the job and the worker are still usable."""

    code = "call_failed"


class CallAbortedError(PlexError):
    """The call was cancelled (by its caller, or by the scheduler) before it finished."""

    code = "call_aborted"


class CallTimeoutError(PlexError, TimeoutError):
    """A call ran past its deadline (``Client.deadlines``, per call kind): it was aborted at the
    coordinator (dropped if queued; a vLLM generate stops, other calls finish unheard)."""

    code = "call_timeout"


class WorkerLostError(PlexError, ConnectionError):
    """The worker executing (or holding the state for) this call stopped answering."""

    code = "worker_lost"


class GangBrokenError(PlexError, ConnectionError):
    """A collective between the workers of a multi-worker job failed or timed out (a member died,
    hung or cannot be reached): the members may have diverged mid-call, so the job's state is
    rebuilt from its snapshot (or the job is lost, as when its worker dies)."""

    code = "gang_broken"


class CoordinatorLostError(PlexError, ConnectionError):
    """The coordinator stopped answering heartbeats, or shut down."""

    code = "coordinator_lost"


class ResultLostError(CoordinatorLostError):
    """The coordinator restarted after the call ran and before its result reached you. The
    message says whether the call changed the job (an optimizer step applied: do not repeat it)
    and where the job stands; calls the restarted coordinator had not seen are sent again instead."""

    code = "result_lost"


class UnknownClientError(PlexError, ConnectionError):
    """This connection has not said Hello to the coordinator (it restarted, or declared the client
    gone): the client library says Hello again, reattaches its jobs and sends their calls again."""

    code = "unknown_client"


class SamplerUnavailableError(PlexError, RuntimeError):
    """The worker's sampler engine (vLLM) is not installed or does not import on its host."""

    code = "sampler_unavailable"


class LocalClusterError(PlexError, RuntimeError):
    """The embedded cluster (``plexrl.local``) could not start."""

    code = "local_cluster"


def _all_subclasses(cls: type[PlexError]) -> list[type[PlexError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


_BY_CODE: dict[str, type[PlexError]] = {c.code: c for c in _all_subclasses(PlexError)}


def from_wire(code: str, message: str) -> PlexError:
    """Rebuild the typed error named by ``code``; unknown codes become a plain ``PlexError``."""
    return _BY_CODE.get(code, PlexError)(message)
