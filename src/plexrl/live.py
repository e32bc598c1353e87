"""Progress of long commands (the examples, pretraining, the benchmarks): a line per job or phase,
redrawn in place on a terminal, plain lines every ``log_every`` steps otherwise (CI logs, pipes).

    view = LiveView(["add", "mul"], total=50)
    view.update("add", done=3, reward=0.41)          # a bar, 3/50, the fields, the elapsed time
    view.update("add", held_out="0.20 -> 0.35")      # a field alone: shown at once in plain mode too
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

BAR = 24


@dataclass
class Line:
    name: str
    total: int
    done: int = 0
    fields: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)


class LiveView:
    def __init__(self, names: list[str], total: int, log_every: int = 10, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.lines = {n: Line(n, total) for n in names}
        self.tty = self.stream.isatty()
        self.log_every = max(1, log_every)
        self._drawn = 0

    def add(self, name: str, total: int) -> None:
        """Another line (a phase that starts later)."""
        self.lines[name] = Line(name, total)

    def update(self, name: str, *, done: int | None = None, **fields: str | float) -> None:
        line = self.lines[name]
        line.done = line.done if done is None else done
        line.fields.update({k: f"{v:.3f}" if isinstance(v, float) else str(v) for k, v in fields.items()})
        if self.tty:
            self._redraw()
        elif done is None or done % self.log_every == 0 or done == line.total:
            print(self.render(line), file=self.stream, flush=True)

    def render(self, line: Line) -> str:
        filled = int(BAR * line.done / max(1, line.total))
        bar = "█" * filled + "·" * (BAR - filled)
        shown = "  ".join(f"{k} {v}" for k, v in line.fields.items())
        elapsed = time.perf_counter() - line.started
        return f"{line.name:12} {bar} {line.done:4}/{line.total}  {shown}  {elapsed:6.0f} s"

    def _redraw(self) -> None:
        if self._drawn:
            self.stream.write(f"\x1b[{self._drawn}F")
        for line in self.lines.values():
            self.stream.write("\x1b[2K" + self.render(line) + "\n")
        self._drawn = len(self.lines)
        self.stream.flush()
