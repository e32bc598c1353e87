"""The coordinator's settings (``plexrl coordinator``'s flags)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from plexrl.coordinator.buckets import Mlfq
from plexrl.protocol.codec import DEFAULT_MAX_MESSAGE_BYTES


@dataclass
class CoordinatorConfig:
    bind: str = "tcp://127.0.0.1:7400"
    heartbeat_interval_s: float = 1.0
    heartbeat_liveness: int = 5  # a peer silent for this many intervals is dead
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    policy: str = "fifo"
    clock: Callable[[], float] = field(default=time.monotonic)
    # A key directory (``plexrl keys init``): CurveZMQ on the socket, peers checked against its
    # allowlists. None: unauthenticated, which only a loopback ``bind`` may be.
    keys: str | None = None
    # A client silent this long (a script's loop may block for a while: longer than a worker's
    # window) leaves its jobs suspended: queued calls dropped, running generates aborted ...
    client_timeout_s: float = 30.0
    # ... for this long, for ``client.reattach(name)``; then they are closed.
    client_grace_s: float = 300.0
    max_calls_per_tenant: int = 20_000  # submitted calls queued or running at once; more: TooManyCallsError
    max_bytes_per_tenant: int = 16 << 30  # and the bytes of their messages (batches, prompts)
    # Jobs whose state is at most this many bytes survive the loss of their worker (colocated jobs:
    # snapshots at every optim_step, kept here with the calls since); 0: none do.
    snapshot_max_bytes: int = 32 << 20
    recovery_wait_s: float = 300.0  # such a job waits this long for a worker that can take it, then fails
    # A worker running a call whose engine makes no progress this long is hung: declared lost.
    # Longer than any one step of work (a model load, one forward or backward); 0: never.
    hang_timeout_s: float = 600.0
    # A job on several workers (a gang): the deadline of its members' rendezvous and of each of
    # their collectives (worker/gang.py), after which the call fails and the gang is rebuilt (at
    # most half of ``hang_timeout_s``).
    gang_timeout_s: float = 120.0
    # A journal file (SQLite): jobs that survive the loss of their worker also survive a restart of
    # the coordinator (started again with the same journal). None: a restart loses every job.
    journal: str | None = None
    # Libra's elastic roles: a ``train`` worker whose pooled jobs are rolling out lends itself to
    # the rollout workers until one of them has training to do (``coordinator/rebalance.py``).
    elastic: bool = False
    move_prior_s: float = 1.0  # what a move is expected to cost before one is measured
    # Libra's buckets (``coordinator/buckets.py``): the ratios of a trajectory's tokens to its job's
    # other trajectories' at the same turn at which it moves a level down each, and the
    # accelerator-seconds of service at which it does (() : service counts for nothing).
    level_peer_ratios: tuple[float, ...] = Mlfq().peer_ratios
    level_service_s: tuple[float, ...] = Mlfq().service_s
    # A Prometheus endpoint (coordinator/metrics.py) on this port of the bind address's host; 0: a
    # free port (logged); None: none.
    metrics_port: int | None = None
    # How a disaggregated or pooled job's new weights reach its other workers: "workers", fetched
    # by them from its home worker's data plane (worker/dataplane.py); "coordinator", through
    # this process in the calls' messages (what bench/weights.py measures the data plane against).
    weights_via: str = "workers"

    def __post_init__(self) -> None:
        if not self.gang_timeout_s > 0:
            raise ValueError(f"gang_timeout_s={self.gang_timeout_s} must be > 0")
        if 0 < self.hang_timeout_s <= self.gang_timeout_s:
            # A gang's members give up on a silent member before it is declared hung.
            self.gang_timeout_s = self.hang_timeout_s / 2
