"""A worker's progress counter: its engine ticks it as work advances, its heartbeat reports it.

The coordinator tells a slow call from a hung engine by it: a worker that runs a call and whose
count stands still for the hang timeout is declared lost. Ticks come from the trainer (each row
group's forward and backward, each optimizer step), from vLLM (each engine step's outputs) and
from state moves. Threads tick without a lock: a lost increment still leaves the count moving.
"""

from __future__ import annotations


class Progress:
    def __init__(self) -> None:
        self.value = 0

    def tick(self) -> None:
        self.value += 1
