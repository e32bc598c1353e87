"""``plexrl top`` in a real terminal (tmux): it shows the cluster's worker and job, redraws in place,
and reports a job that opens while it watches. The pane's output is streamed through a FIFO
(``tmux pipe-pane``) and read until the expected text arrives, with a deadline."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import plexrl

pytestmark = pytest.mark.asyncio
if shutil.which("tmux") is None:
    if os.environ.get("PLEXRL_REQUIRE_VLLM"):  # CI: everything installed, nothing skipped
        raise RuntimeError("tmux is needed to test plexrl top's terminal view")
    pytest.skip("tmux is not installed", allow_module_level=True)


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True, timeout=30).stdout


class Pane:
    """What the program in a tmux pane writes, read from a FIFO as it comes."""

    def __init__(self, fifo: Path) -> None:
        self.fifo = fifo
        self.seen = b""
        self._stream = None

    def _read_until(self, text: bytes) -> None:
        if self._stream is None:
            self._stream = open(self.fifo, "rb", buffering=0)  # noqa: SIM115  # blocks until tmux's writer opens it
        while text not in self.seen:
            chunk = self._stream.read(65536)
            if not chunk:
                raise AssertionError(f"the pane closed before it showed {text!r}")
            self.seen += chunk

    async def shows(self, text: str, timeout_s: float = 60.0) -> None:
        self.seen = b""
        async with asyncio.timeout(timeout_s):
            await asyncio.to_thread(self._read_until, text.encode())

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()


async def test_plexrl_top_draws_workers_and_jobs_in_place_and_reports_a_new_job(
    tiny_model: Path, tmp_path: Path
) -> None:
    session = f"plexrl-top-{uuid.uuid4().hex[:8]}"
    fifo = tmp_path / "pane"
    os.mkfifo(fifo)
    cluster = plexrl.local(workers=1)
    async with cluster, plexrl.job("watched", model=tiny_model):
        env = [f"{k}={v}" for k, v in cluster.client_env().items()]
        command = [sys.executable, "-m", "plexrl", "top", "--coordinator", cluster.address, "--interval", "0.3"]
        # The pane's size, not a COLUMNS / LINES this process may carry, sets the view's width.
        shell = ["env", "-u", "COLUMNS", "-u", "LINES", *env, *command]
        tmux("new-session", "-d", "-s", session, "-x", "200", "-y", "50", *shell)
        pane = Pane(fifo)
        try:
            tmux("pipe-pane", "-t", session, "-o", f"cat > {fifo}")
            await pane.shows("watched")
            await pane.shows("local-0")
            async with plexrl.job("newcomer", model=tiny_model):
                await pane.shows("job newcomer")  # the recent-events line
            for _ in range(3):
                await pane.shows("plexrl top")  # a few more refreshes
            screen = tmux("capture-pane", "-p", "-t", session)
        finally:
            subprocess.run(["tmux", "kill-session", "-t", session], check=False, timeout=30)
            pane.close()
    assert screen.count("plexrl top") == 1  # redrawn in place, not scrolled
    assert sum("watched" in line for line in screen.splitlines()) == 1 and "local-0" in screen  # one row
    assert "opened on" in screen and "job newcomer" in screen and "closed" in screen
