"""Which rows of a call each member of a gang (a job on several workers) runs.

Every member gets the whole call and picks its rows itself, by the same deterministic rule, so
the coordinator does no tensor work and every member knows the batch's totals without asking.
"""

from __future__ import annotations

import numpy as np


def member_rows(lengths: np.ndarray, rows: np.ndarray, rank: int, world: int) -> np.ndarray:
    """The rows (of ``rows``, indices into ``lengths``) that member ``rank`` of ``world`` runs:
    longest first, each to the member with the fewest tokens so far (ties: the lowest rank), so
    the members' shares of the work differ by at most one row."""
    load = np.zeros(world, dtype=np.int64)
    mine: list[int] = []
    for i in rows[np.argsort(-lengths[rows], kind="stable")]:
        member = int(np.argmin(load))
        load[member] += int(lengths[i])
        if member == rank:
            mine.append(int(i))
    return np.array(sorted(mine), dtype=np.int64)
