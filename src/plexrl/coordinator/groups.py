"""Worker groups: where a job that spans several devices may live (aligned blocks of one node).

A group of ``k`` devices (``k`` in ``GROUP_SIZES``) is ``k`` workers of one node (one host, one
NVLink domain) whose device indices are ``[i, i + k)`` with ``i`` a multiple of ``k``: the buddy
allocator's rule. Blocks of one size never straddle blocks of the next, so two 2-device groups
never break two 4-device blocks, and jobs packed into the low blocks of a node leave its high
blocks whole for the next large group. Workers that name no node take single-device jobs only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

GROUP_SIZES = (1, 2, 4, 8)


class Member(Protocol):
    @property
    def node(self) -> str: ...
    @property
    def index(self) -> int: ...


W = TypeVar("W", bound=Member)


def aligned_blocks(workers: Iterable[W], k: int) -> list[tuple[W, ...]]:
    """Every block of ``k`` workers a group may take: node by node, by first index."""
    by_node: dict[str, dict[int, W]] = {}
    for w in workers:
        if w.node:
            by_node.setdefault(w.node, {})[w.index] = w
    blocks: list[tuple[W, ...]] = []
    for node in sorted(by_node):
        on_node = by_node[node]
        for start in sorted(i for i in on_node if i % k == 0):
            block = [on_node.get(start + j) for j in range(k)]
            if all(w is not None for w in block):
                blocks.append(tuple(w for w in block if w is not None))
    return blocks


def least_loaded(blocks: list[tuple[W, ...]], load: Callable[[W], float]) -> tuple[W, ...]:
    """The block whose busiest member is least loaded (then the least loaded in all); ties: the
    first (first fit: groups fill nodes from their low indices)."""
    return min(blocks, key=lambda b: (max(load(w) for w in b), sum(load(w) for w in b)))
