"""An embedded cluster: a coordinator and workers as child processes of this script.

It is the shared deployment's code on one machine, not a separate path: the same
``plexrl coordinator`` and ``plexrl worker`` commands over loopback TCP. Children are torn down
on exit, on error and on Ctrl-C, and die with this process if it is killed (PR_SET_PDEATHSIG).
It is authenticated like a shared one: a key directory made for the run (a temporary folder of
mode 0700, removed at the end) with one worker key and one admin key, this script's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

from plexrl.client.connection import Client
from plexrl.client.hosts import Host
from plexrl.errors import LocalClusterError
from plexrl.protocol import auth

log = logging.getLogger("plexrl.local")


class LocalCluster:
    """``async with plexrl.local(workers=2) as client:`` starts, connects, and tears down."""

    def __init__(
        self,
        workers: int = 1,
        *,
        device: str = "cpu",
        heartbeat_interval_s: float = 1.0,
        heartbeat_liveness: int = 5,
        start_timeout_s: float = 180.0,
        threads_per_worker: int | None = None,
        log_level: str = "WARNING",
        max_message_bytes: int | None = None,
        sampler: str | None = None,
        policy: str = "fifo",
        memory_budget_bytes: int | None = None,
        cpus_per_worker: int | None = None,
        max_num_seqs: int | None = None,
        max_loras: int | None = None,
        max_lora_rank: int | None = None,
        engine_sleep: str | None = None,
        checkpoint_root: str | os.PathLike[str] | None = None,
        client_timeout_s: float | None = None,
        client_grace_s: float | None = None,
        hang_timeout_s: float | None = None,
        gang_timeout_s: float | None = None,
        snapshot_max_bytes: int | None = None,
        journal: str | os.PathLike[str] | None = None,
        roles: list[str] | None = None,
        buckets: list[int] | None = None,
        elastic: bool = False,
        move_prior_s: float | None = None,
        level_peers: tuple[float, ...] | None = None,
        level_service_s: tuple[float, ...] | None = None,
        metrics_port: int | None = None,
        weights_via: str = "workers",
        hosts: list[Host] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers}: an embedded cluster needs at least one worker")
        for name, given in (("roles", roles), ("buckets", buckets)):
            if given is not None and len(given) != workers:
                raise ValueError(f"{name}={given}: give one per worker ({workers})")
        self.workers = workers
        self.device = device
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_liveness = heartbeat_liveness
        self.start_timeout_s = start_timeout_s
        # One core stays free for the coordinator and the clients, whose latency every call pays.
        self.threads_per_worker = threads_per_worker or max(1, ((os.cpu_count() or 1) - 1) // workers)
        self.log_level = log_level
        self.max_message_bytes = max_message_bytes
        self.sampler = sampler  # "vllm" | "hf"; None = the worker's default
        self.policy = policy  # the coordinator's scheduling policy: fifo | dedicated | plex
        self.memory_budget_bytes = memory_budget_bytes  # each worker's device budget (None: its default)
        self.max_num_seqs = max_num_seqs  # vLLM workers: sequences decoded at once (None: vLLM's default)
        self.max_loras = max_loras  # vLLM workers: adapters one batch may mix (None: the worker's default)
        self.max_lora_rank = max_lora_rank  # vLLM workers: the largest adapter rank (None: the worker's default)
        self.engine_sleep = engine_sleep  # vLLM workers: --engine-sleep (None: the worker's default, auto)
        # Workers' checkpoint root; this script's jobs save under ROOT/local (None: the worker's default).
        self.checkpoint_root = checkpoint_root
        # Client leases (None: the coordinator's defaults): silent this long, a client's jobs are
        # suspended; suspended this long, they are closed.
        self.client_timeout_s = client_timeout_s
        self.client_grace_s = client_grace_s
        self.hang_timeout_s = hang_timeout_s  # a worker running a call without progress this long is lost
        self.gang_timeout_s = gang_timeout_s  # a gang's members wait this long for each other in a collective
        self.snapshot_max_bytes = snapshot_max_bytes  # jobs up to this size survive their worker (0: none)
        self.journal = journal  # the coordinator's journal: its jobs survive its restart (None: none)
        # Libra: worker i's role ("both", "rollout", "train") and bucket; ``elastic``: the
        # coordinator lends train workers to rollout while their pooled jobs roll out.
        self.roles = roles or ["both"] * workers
        self.buckets = buckets or [0] * workers
        self.elastic = elastic
        self.move_prior_s = move_prior_s  # with elastic: what a move costs until one is measured (None: default)
        # What moves a pooled trajectory down the levels (coordinator/buckets.py; None: the default,
        # (): none): ratios of its tokens to its peers', seconds of service.
        self.level_peers, self.level_service_s = level_peers, level_service_s
        self.weights_via = weights_via  # "workers" (their data plane) or "coordinator" (bench/weights.py's baseline)
        # On several hosts (network namespaces, client/hosts.py): the coordinator on the first, worker
        # i on host 1 + i (round robin over the rest); None: all on this one, over loopback.
        self.hosts = hosts
        self.metrics_port = metrics_port  # the coordinator's Prometheus endpoint on 127.0.0.1 (None: none)
        # Pinned: worker i gets cores of its own (the last ones, so the coordinator and this script,
        # which run on the first, rarely compete with a worker); None: no pinning.
        self.cores = _worker_cores(workers, cpus_per_worker) if cpus_per_worker else None
        self.address = ""
        self.coordinator: asyncio.subprocess.Process | None = None
        self.worker_processes: list[asyncio.subprocess.Process] = []
        # Each worker runs in a process group of its own with the engine processes it starts (vLLM's
        # engine core): a worker that dies leaves them behind, and the group is how they are freed.
        self._worker_groups: list[int] = []
        self.client: Client | None = None
        self.keys: Path | None = None  # this run's key directory, while the cluster runs

    def _command(self, host: Host | None, *args: str) -> list[str]:
        argv = [sys.executable, "-m", "plexrl", *args, "--log-level", self.log_level, "--parent-pid", str(os.getpid())]
        return host.command(argv) if host is not None else argv

    def host_of(self, worker: int | None) -> Host | None:
        """The host of worker ``worker`` (None: the coordinator's); None when all run on this one."""
        if not self.hosts:
            return None
        if worker is None or len(self.hosts) == 1:
            return self.hosts[0]
        return self.hosts[1 + worker % (len(self.hosts) - 1)]

    async def __aenter__(self) -> Client:
        try:
            async with asyncio.timeout(self.start_timeout_s):
                await self._start()
        except TimeoutError:
            await self._stop()
            raise LocalClusterError(
                f"the embedded cluster did not start within {self.start_timeout_s} s; see the workers' logs above"
            ) from None
        except BaseException:
            await self._stop()
            raise
        assert self.client is not None
        return self.client

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stop()

    def credentials(self) -> auth.Credentials:
        """The admin key of this run, for another client of the running cluster (``plexrl.connect``)."""
        env = self.client_env()
        return auth.Credentials.load(env["PLEXRL_KEY"], env["PLEXRL_COORDINATOR_KEY"])

    def client_env(self) -> dict[str, str]:
        """The environment a client process needs to connect (``$PLEXRL_KEY``, ``$PLEXRL_COORDINATOR_KEY``)."""
        if self.keys is None:
            raise LocalClusterError("the embedded cluster is not running")
        return {
            "PLEXRL_KEY": str(self.keys / "secret" / "local.key_secret"),
            "PLEXRL_COORDINATOR_KEY": str(self.keys / "coordinator.key"),
        }

    async def _start(self) -> None:
        self.keys = Path(tempfile.mkdtemp(prefix="plexrl-keys-"))  # mode 0700
        auth.init_dir(self.keys)
        auth.add_key(self.keys, "local-workers", "worker")
        auth.add_key(self.keys, "local", "admin")
        await self.start_coordinator()
        for i in range(self.workers):
            await self.start_worker(i)
        self.client = Client(self.address, credentials=self.credentials())
        await self.client.__aenter__()
        ready = asyncio.ensure_future(self.client.status(min_workers=self.workers))
        exits = [asyncio.ensure_future(p.wait()) for p in [self.coordinator, *self.worker_processes] if p is not None]
        try:
            done, _ = await asyncio.wait([ready, *exits], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in exits:
                f.cancel()
        if ready not in done:
            ready.cancel()
            raise LocalClusterError("a process of the embedded cluster exited while starting; see its log above")
        log.info("embedded cluster ready at %s with %d workers", self.address, self.workers)

    async def start_coordinator(self) -> asyncio.subprocess.Process:
        """Start the coordinator: at start-up on a free port, or again on the same address (and
        journal) after it died (a test or a chaos run kills and restarts it; its clients and
        workers reconnect by themselves)."""
        if self.keys is None:
            raise LocalClusterError("the embedded cluster is not running")
        extra = ["--max-message-bytes", str(self.max_message_bytes)] if self.max_message_bytes else []
        self.coordinator = await asyncio.create_subprocess_exec(
            *self._command(
                self.host_of(None),
                "coordinator",
                "--keys", str(self.keys),
                "--bind", self.address or f"tcp://{host.address if (host := self.host_of(None)) else '127.0.0.1'}:0",
                "--print-address",
                "--heartbeat-interval", str(self.heartbeat_interval_s),
                "--heartbeat-liveness", str(self.heartbeat_liveness),
                "--policy", self.policy,
                *(["--client-timeout", str(self.client_timeout_s)] if self.client_timeout_s is not None else []),
                *(["--client-grace", str(self.client_grace_s)] if self.client_grace_s is not None else []),
                *(["--hang-timeout", str(self.hang_timeout_s)] if self.hang_timeout_s is not None else []),
                *(["--gang-timeout", str(self.gang_timeout_s)] if self.gang_timeout_s is not None else []),
                *(["--snapshot-max-bytes", str(self.snapshot_max_bytes)] if self.snapshot_max_bytes is not None else []),
                *(["--journal", os.fspath(self.journal)] if self.journal is not None else []),
                *(["--elastic"] if self.elastic else []),
                *(["--metrics-port", str(self.metrics_port)] if self.metrics_port is not None else []),
                "--weights-via", self.weights_via,
                *(["--move-prior", str(self.move_prior_s)] if self.move_prior_s is not None else []),
                *(["--level-peers", _thresholds(self.level_peers)] if self.level_peers is not None else []),
                *(["--level-service", _thresholds(self.level_service_s)] if self.level_service_s is not None else []),
                *extra,
            ),
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert self.coordinator.stdout is not None
        line = await self.coordinator.stdout.readline()
        if not line.startswith(b"tcp://"):
            raise LocalClusterError(f"the coordinator did not start (exit code {await self.coordinator.wait()})")
        self.address = line.decode().strip()
        return self.coordinator

    async def start_worker(self, i: int) -> asyncio.subprocess.Process:
        """Start worker ``i`` (``local-i``, on worker i's cores): at start-up, or again after it
        died (it registers as a new worker; a test or a chaos run kills and replaces workers)."""
        if self.keys is None:
            raise LocalClusterError("the embedded cluster is not running")
        extra = ["--max-message-bytes", str(self.max_message_bytes)] if self.max_message_bytes else []
        cmd = self._command(
            self.host_of(i),
            "worker",
            "--coordinator", self.address,
            "--device", self.device,
            "--name", f"local-{i}",
            "--key", str(self.keys / "secret" / "local-workers.key_secret"),
            "--coordinator-key", str(self.keys / "coordinator.key"),
            *(["--cpus", ",".join(map(str, self.cores[i]))] if self.cores else
              ["--threads", str(self.threads_per_worker)]),
            *(["--max-num-seqs", str(self.max_num_seqs)] if self.max_num_seqs else []),
            *(["--max-loras", str(self.max_loras)] if self.max_loras else []),
            *(["--max-lora-rank", str(self.max_lora_rank)] if self.max_lora_rank else []),
            *(["--engine-sleep", self.engine_sleep] if self.engine_sleep else []),
            *(["--sampler", self.sampler] if self.sampler else []),
            *(["--checkpoint-root", os.fspath(self.checkpoint_root)] if self.checkpoint_root else []),
            *(["--memory-budget", str(self.memory_budget_bytes)] if self.memory_budget_bytes is not None else []),
            "--role", self.roles[i % self.workers], "--bucket", str(self.buckets[i % self.workers]),
            *self._place(i),
            *extra,
        )  # fmt: skip
        process = await asyncio.create_subprocess_exec(*cmd, start_new_session=True)
        self.worker_processes.append(process)
        self._worker_groups.append(process.pid)
        return process

    def _place(self, i: int) -> list[str]:
        """Worker ``i``'s node (its host) and device index there (its rank among that host's
        workers), so that jobs on several workers (``devices=N``) find aligned blocks."""
        host = self.host_of(i)
        on_host = [j for j in range(self.workers) if self.host_of(j) == host]
        return ["--node", host.netns if host is not None else "local", "--index", str(on_host.index(i))]

    def reap(self, process: asyncio.subprocess.Process) -> None:
        """Free what a dead worker left behind (its engine processes: a SIGKILLed worker cannot stop
        them, and vLLM's engine core waits minutes for a front-end that is gone), as a supervisor
        does before it starts a replacement (systemd's default ``KillMode=control-group``)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)

    async def _stop(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await client.__aexit__(None, None, None)
        procs = [p for p in [*self.worker_processes, self.coordinator] if p is not None and p.returncode is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), timeout=10.0)
            except TimeoutError:
                p.kill()
                await p.wait()
        for group in self._worker_groups:  # engine processes of workers that died on the way
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        self._worker_groups = []
        self.worker_processes = []
        self.coordinator = None
        if self.keys is not None:
            shutil.rmtree(self.keys, ignore_errors=True)
            self.keys = None


def _worker_cores(workers: int, per_worker: int) -> list[list[int]]:
    """Disjoint core lists for ``workers`` workers of ``per_worker`` cores each, from the last core down."""
    allowed = sorted(os.sched_getaffinity(0))
    if workers * per_worker > len(allowed):
        raise LocalClusterError(
            f"{workers} workers of {per_worker} core(s) each need {workers * per_worker} cores; this process may "
            f"use {len(allowed)} ({','.join(map(str, allowed))}): use fewer workers or cpus_per_worker=None"
        )
    top = allowed[len(allowed) - workers * per_worker :]
    return [top[i * per_worker : (i + 1) * per_worker] for i in range(workers)]


def local(workers: int = 1, **options: Any) -> LocalCluster:
    """An embedded cluster for this script: ``async with plexrl.local(workers=2):``.

    ``options`` are those of :class:`LocalCluster` (device, heartbeats, start timeout, ...).
    """
    return LocalCluster(workers, **options)


def _thresholds(values: tuple[float, ...]) -> str:
    """``plexrl coordinator``'s form of level thresholds."""
    return ",".join(map(str, values)) or "off"
