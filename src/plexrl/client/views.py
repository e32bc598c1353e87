"""What ``plexrl status`` prints once and ``plexrl top`` keeps live: rows of workers and jobs from a
coordinator's status, and the swaps and faults between two of them."""

from __future__ import annotations

from dataclasses import dataclass

from plexrl.protocol import messages as m


@dataclass(frozen=True)
class Column:
    title: str
    width: int
    right: bool = False  # numbers: right-aligned


WORKER_COLUMNS = (
    Column("worker", 8), Column("name", 16), Column("device", 8), Column("jobs", 4, True), Column("calls", 7, True),
    Column("busy_s", 8, True), Column("busy%", 6, True), Column("state/budget", 20, True), Column("role", 11),
)  # fmt: skip
JOB_COLUMNS = (
    Column("job", 24), Column("worker", 8), Column("state", 8), Column("tier", 9), Column("queued", 6, True),
    Column("calls", 7, True), Column("wall_s", 8, True), Column("accel_s", 8, True), Column("cost/held", 9, True),
    Column("swaps", 6, True), Column("swap_s", 7, True), Column("sampler", 8, True), Column("tenant", 12),
    Column("name", 16),
)  # fmt: skip


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GiB"


def worker_rows(status: m.StatusReply, previous: m.StatusReply | None = None) -> list[list[str]]:
    """One row per worker. Busy % is over the coordinator's uptime, or since ``previous``."""
    before = {w.worker_id: w for w in previous.workers} if previous is not None else {}
    elapsed = status.uptime_s - previous.uptime_s if previous is not None else status.uptime_s
    rows = []
    for w in status.workers:
        busy = w.busy_s - (before[w.worker_id].busy_s if w.worker_id in before else 0.0)
        rows.append([
            w.worker_id, w.name, w.device, str(len(w.jobs)), str(w.calls_done), f"{w.busy_s:.1f}",
            f"{100 * busy / max(elapsed, 1e-9):.1f}%", f"{size(w.state_bytes_on_device)}/{size(w.memory_budget_bytes)}",
            w.role + (f" b{w.bucket}" if w.bucket else ""),
        ])  # fmt: skip
    return rows


def job_rows(status: m.StatusReply) -> list[list[str]]:
    """One row per job (another tenant's without its id, name or numbers, as the coordinator sends it)."""
    return [
        [
            j.job_id or "(another tenant)",
            j.worker_id,
            j.state,
            j.tier,
            str(j.queued),
            str(j.calls_done),
            f"{j.wall_s:.1f}",
            f"{j.accelerator_s:.2f}",
            f"{j.cost_vs_held:.2f}",
            str(j.swaps),
            f"{j.swap_s:.3f}",
            j.sampler_worker_id or j.worker_id,
            j.owner,
            j.name,
        ]
        for j in status.jobs
    ]


def plain(columns: tuple[Column, ...], rows: list[list[str]]) -> str:
    """Fixed-width lines: a header, then the rows (each cell cut to its column's width)."""

    def line(cells: list[str]) -> str:
        return " ".join(
            f"{c[: col.width]:>{col.width}}" if col.right else f"{c[: col.width]:{col.width}}"
            for col, c in zip(columns, cells, strict=True)
        ).rstrip()

    return "\n".join([line([c.title for c in columns]), *(line(r) for r in rows)])


def events(previous: m.StatusReply, status: m.StatusReply) -> list[str]:
    """What changed between two status replies that an operator watches for: workers joining or
    lost, jobs opened, closed, recovered onto another worker, or swapped between device and host."""
    out = []
    before_w = {w.worker_id: w for w in previous.workers}
    now_w = {w.worker_id: w for w in status.workers}
    out += [f"worker {w.name} ({w.worker_id}) joined" for k, w in now_w.items() if k not in before_w]
    out += [f"worker {w.name} ({w.worker_id}) is gone" for k, w in before_w.items() if k not in now_w]
    before_j = {j.job_id: j for j in previous.jobs if j.job_id}
    now_j = {j.job_id: j for j in status.jobs if j.job_id}
    out += [f"job {j.name} ({j.job_id}) opened on {j.worker_id}" for k, j in now_j.items() if k not in before_j]
    out += [f"job {j.name} ({j.job_id}) closed" for k, j in before_j.items() if k not in now_j]
    for k, j in now_j.items():
        was = before_j.get(k)
        if was is None:
            continue
        if j.recoveries > was.recoveries:
            out.append(f"job {j.name} lost its worker: rebuilt on {j.worker_id}")
        if j.swaps > was.swaps:
            moved = size(j.swap_bytes - was.swap_bytes)
            out.append(f"job {j.name} swapped {j.swaps - was.swaps}x ({moved}), now on {j.tier or 'device'}")
        if j.state != was.state:
            out.append(f"job {j.name}: {was.state} -> {j.state}")
    return out
