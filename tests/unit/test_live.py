"""Progress lines: plain lines every few steps when not a terminal, lines redrawn in place on one."""

from __future__ import annotations

import io

from plexrl.live import LiveView


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_without_a_terminal_a_line_every_few_steps_and_at_the_end_and_each_field_alone() -> None:
    out = io.StringIO()
    view = LiveView(["add", "mul"], total=5, log_every=2, stream=out)
    for step in range(1, 6):
        view.update("add", done=step, reward=0.5)
    view.update("mul", held_out="0.20 -> 0.35")
    lines = out.getvalue().splitlines()
    assert [line.split()[2] for line in lines[:3]] == ["2/5", "4/5", "5/5"]
    assert "reward 0.500" in lines[0] and "\x1b" not in out.getvalue()
    assert lines[3].startswith("mul") and "held_out 0.20 -> 0.35" in lines[3]


def test_on_a_terminal_every_update_redraws_all_lines_in_place() -> None:
    out = Terminal()
    view = LiveView(["add", "mul"], total=4, stream=out)
    view.update("add", done=1)
    view.update("mul", done=2)
    text = out.getvalue()
    assert text.count("\x1b[2K") == 4  # two lines, drawn twice
    assert text.count("\x1b[2F") == 1  # the second draw moved back over the first
    assert "2/4" in text.rsplit("\x1b[2F", 1)[1]
