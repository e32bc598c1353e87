"""A live per-job view for the GRPO example: progress bars redrawn in place on a terminal,
plain lines every few steps otherwise (CI logs, pipes)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field


@dataclass
class JobLine:
    name: str
    steps: int
    step: int = 0
    reward: float = 0.0
    held_out: str = "…"
    started: float = field(default_factory=time.perf_counter)


class LiveView:
    def __init__(self, names: list[str], steps: int, log_every: int = 10) -> None:
        self.lines = {n: JobLine(n, steps) for n in names}
        self.tty = sys.stdout.isatty()
        self.log_every = log_every
        self._drawn = 0

    def update(
        self, name: str, *, step: int | None = None, reward: float | None = None, held_out: str | None = None
    ) -> None:
        line = self.lines[name]
        line.step = line.step if step is None else step
        line.reward = line.reward if reward is None else reward
        line.held_out = line.held_out if held_out is None else held_out
        if self.tty:
            self._redraw()
        elif (step is not None and (step % self.log_every == 0 or step == line.steps)) or held_out is not None:
            print(self._render(line), flush=True)

    def _render(self, line: JobLine) -> str:
        width = 24
        done = int(width * line.step / max(1, line.steps))
        bar = "█" * done + "·" * (width - done)
        elapsed = time.perf_counter() - line.started
        return (
            f"{line.name:10} {bar} {line.step:4}/{line.steps}  reward {line.reward:5.2f}  "
            f"held-out {line.held_out:12} {elapsed:6.0f} s"
        )

    def _redraw(self) -> None:
        if self._drawn:
            sys.stdout.write(f"\x1b[{self._drawn}F")
        for line in self.lines.values():
            sys.stdout.write("\x1b[2K" + self._render(line) + "\n")
        self._drawn = len(self.lines)
        sys.stdout.flush()
