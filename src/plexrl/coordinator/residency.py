"""Residency: where each job's state is on its home worker, and when moving it pays (pure).

A job's state (trainable weights or adapter, optimizer moments, sampler state) is ``device``,
``host``, or in transit between them. A worker's device holds at most ``memory_bytes`` of it. A
call runs only when its job's state is on the device; bringing it in may need another job's
state moved out. ``plex`` moves a resident job out only when the idle gap expected before its
next call exceeds the cost of moving it out and back (the break-even rule), unless the waiting
job has waited past its starvation bound; naive policies move out the least recently used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plexrl.names import Tier

DEVICE: Tier = "device"
HOST: Tier = "host"
TO_DEVICE: Tier = "to_device"
TO_HOST: Tier = "to_host"
GAP_EWMA = 0.5  # weight of the newest idle gap in a job's expected gap
STARVATION_TRANSFERS = 20.0  # a waiting job may force a move after this many of its own transfer times


@dataclass(slots=True)
class Residency:
    """One job's state on its home worker."""

    state_bytes: int
    tier: Tier = DEVICE
    last_done_s: float | None = None  # when its last call finished (None: never ran)
    expected_gap_s: float | None = None  # EWMA of its idle gaps between calls; None: unknown
    waiting_since_s: float | None = None  # its next call is ready but its state is not resident

    def observe_gap(self, gap_s: float) -> None:
        if self.expected_gap_s is None:
            self.expected_gap_s = gap_s
        else:
            self.expected_gap_s = GAP_EWMA * gap_s + (1 - GAP_EWMA) * self.expected_gap_s


def transfer_s(state_bytes: int, bytes_per_s: float) -> float:
    return state_bytes / bytes_per_s if bytes_per_s > 0 else math.inf


def pays_to_evict(victim: Residency, bytes_per_s: float) -> bool:
    """The break-even rule: evict only if the victim is expected to stay idle longer than moving
    it out and back in takes. A job with no observed gap yet is never evicted by this rule."""
    if victim.expected_gap_s is None:
        return False
    return victim.expected_gap_s > 2 * transfer_s(victim.state_bytes, bytes_per_s)


def starving(waiting: Residency, now: float, bytes_per_s: float) -> bool:
    """The waiting job has waited long enough that a move is forced (no starvation)."""
    if waiting.waiting_since_s is None:
        return False
    bound = max(1.0, STARVATION_TRANSFERS * transfer_s(waiting.state_bytes, bytes_per_s))
    return now - waiting.waiting_since_s >= bound
