"""``plexrl top``: a coordinator's workers and jobs, refreshed in place, with recent swaps and faults.

    plexrl top --coordinator tcp://head:7400 [--interval 1.0]

Busy % is over the last refresh (``plexrl status`` shows it over the coordinator's uptime). Jobs
show what the coordinator lets the asker see (another tenant's: where they run and their state).
On a terminal the view redraws in place (rich's ``Live``); anywhere else each refresh prints
plain lines, so its output can be logged. Ctrl-C ends it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from plexrl.client import views
from plexrl.client.connection import Client
from plexrl.protocol import auth
from plexrl.protocol import messages as m

RECENT = 8  # events shown


def _table(title: str, columns: tuple[views.Column, ...], rows: list[list[str]]) -> Table:
    table = Table(title=title, title_justify="left", expand=False, pad_edge=False)
    for c in columns:
        table.add_column(c.title, justify="right" if c.right else "left", no_wrap=True, max_width=max(c.width, 24))
    for r in rows:
        table.add_row(*r)
    return table


def frame(address: str, status: m.StatusReply, previous: m.StatusReply | None, recent: list[str]) -> Group:
    """One screen: a header, the workers, the jobs, the recent events."""
    header = Text(f"plexrl top  {address}  up {status.uptime_s:.0f} s  {len(status.workers)} workers  "
                  f"{len(status.jobs)} jobs  {time.strftime('%H:%M:%S')}", style="bold")  # fmt: skip
    return Group(
        header,
        _table("workers", views.WORKER_COLUMNS, views.worker_rows(status, previous)),
        _table("jobs", views.JOB_COLUMNS, views.job_rows(status)),
        Text("recent: " + ("none yet" if not recent else ""), style="dim"),
        *(Text(f"  {e}") for e in recent),
    )


async def run(
    address: str, credentials: auth.Credentials | None, interval_s: float, console: Console | None = None
) -> None:
    """Poll ``address``'s status every ``interval_s`` and show it until cancelled."""
    console = console or Console()
    recent: collections.deque[str] = collections.deque(maxlen=RECENT)
    async with Client(address, connect_timeout_s=10.0, credentials=credentials) as client:
        previous: m.StatusReply | None = None
        status = await client.status()
        with contextlib.ExitStack() as stack:
            live = stack.enter_context(Live(console=console, auto_refresh=False)) if console.is_terminal else None
            while True:
                view = frame(address, status, previous, list(recent))
                if live is not None:
                    live.update(view, refresh=True)
                else:
                    console.print(view)
                await asyncio.sleep(interval_s)  # the refresh period
                previous, status = status, await client.status()
                recent.extend(f"{time.strftime('%H:%M:%S')} {e}" for e in views.events(previous, status))
