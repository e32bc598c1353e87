"""plexrl on a Ray cluster: a coordinator and one worker per device, as Ray actors Ray restarts.

``plexrl.ray.up("head:6379")`` (and ``plexrl up --ray head:6379``) connects to a running Ray
cluster and brings plexrl up on it: a coordinator (a Ray actor, or one already running that
``coordinator=`` names) and one worker per GPU of the cluster (per ``cpus_per_worker`` CPUs on a
CPU-only one), placed by a placement group with one bundle per device. Each actor runs the real
``plexrl coordinator`` / ``plexrl worker`` command as its child process, so vLLM spawns its engine
processes as it does anywhere else, and dies when that process exits: Ray then restarts the actor,
whose new worker registers with the coordinator as a new worker. Needs ``pip install 'plexrl[ray]'``
on the driver and on every node; ``import plexrl`` never imports Ray.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any, TypeVar

from plexrl.client.connection import Client
from plexrl.errors import InvalidRequestError, PlexError
from plexrl.protocol import auth

__all__ = ["RayCluster", "RayClusterError", "up"]

T = TypeVar("T")

WORKER_KEY = "ray-workers"  # the worker key of a coordinator actor's key directory
ADMIN_KEY = "ray"  # the driver's key: it waits for workers and hands itself to clients


class RayClusterError(PlexError, RuntimeError):
    """plexrl could not come up on the Ray cluster: it is unreachable, or the coordinator, the
    placement group or the workers were not ready in time (their logs reach the driver's stderr)."""

    code = "ray_cluster"


class PlexrlProcess:
    """A Ray actor that runs one ``plexrl`` command on its node and dies when that process exits,
    so that Ray restarts it (and the command) as its ``max_restarts`` allow.

    ``files`` (relative path -> bytes: keys; a path ending in "/" makes a folder) are written to a
    private folder (mode 0700) first; ``{files}`` in ``args`` names that folder and ``{node_ip}``
    this node's address.
    """

    def __init__(self, args: list[str], files: dict[str, bytes], announces_address: bool) -> None:
        import ray

        self._stopping = False
        self._dir = Path(tempfile.mkdtemp(prefix="plexrl-ray-"))
        node_ip = ray.util.get_node_ip_address()
        argv = [arg.replace("{files}", str(self._dir)).replace("{node_ip}", node_ip) for arg in args]
        try:
            self._write(files)
            # Its own session: the engine processes a worker starts (vLLM's) share its process group,
            # which is how they are freed once it is gone. --parent-pid: it dies with this actor.
            self._process = subprocess.Popen(
                [sys.executable, "-m", "plexrl", *argv, "--parent-pid", str(os.getpid())],
                stdout=subprocess.PIPE if announces_address else None,
                start_new_session=True,
            )
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._address = ""
        if announces_address:
            assert self._process.stdout is not None
            self._address = self._process.stdout.readline().decode().strip()
            if not self._address.startswith("tcp://"):
                self._free()
                raise RayClusterError(f"`plexrl {argv[0]}` did not start (exit code {self._process.wait()})")
        # Lives as long as the process it watches; ends this actor with it.
        threading.Thread(target=self._watch, name="plexrl-process-watch", daemon=True).start()

    def _write(self, files: dict[str, bytes]) -> None:
        for name, data in files.items():
            path = self._dir / name
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if name.endswith("/"):
                path.mkdir(mode=0o700, exist_ok=True)
            else:
                path.touch(mode=0o600)
                path.write_bytes(data)

    def _watch(self) -> None:
        if self._process.stdout is not None:  # keep the pipe drained: a full one would block the process
            for line in self._process.stdout:
                sys.stdout.write(line.decode(errors="replace"))
        code = self._process.wait()
        if self._stopping:
            return
        self._free()
        print(f"plexrl: process {self._process.pid} exited with {code}; Ray restarts this actor", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)  # an actor that dies unexpectedly is what Ray restarts

    def _free(self) -> None:
        """Free what the process leaves behind: its engine processes (a SIGKILLed worker cannot stop
        them) and its key files."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, signal.SIGKILL)
        shutil.rmtree(self._dir, ignore_errors=True)

    def address(self) -> str:
        """The endpoint the command printed (a coordinator's), else ``""``."""
        return self._address

    def pid(self) -> int:
        """The ``plexrl`` process's id (on this actor's node)."""
        return self._process.pid

    def stop(self, timeout_s: float) -> int:
        """Stop the command (SIGTERM; SIGKILL after ``timeout_s``) without ending the actor."""
        self._stopping = True
        with contextlib.suppress(ProcessLookupError):
            self._process.terminate()
        try:
            code = self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            code = self._process.wait()
        self._free()
        return code


class RayCluster:
    """plexrl running on a Ray cluster (what :func:`up` returns): ``address`` is the coordinator's
    endpoint for ``plexrl.connect`` and ``--coordinator``; ``down()`` (or leaving ``with`` /
    ``async with``) stops the actors this started, never a coordinator it was given."""

    def __init__(self, ray_address: str, *, owns_ray: bool) -> None:
        self.ray_address = ray_address
        self.address = ""
        self.coordinator: Any = None  # the coordinator's actor; None with a coordinator given to up()
        self.workers: list[Any] = []  # the workers' actors, one per device (PlexrlProcess)
        self.placement_group: Any = None
        self.keys: Path | None = None  # the coordinator actor's key directory (its admin key is this driver's)
        self.credentials: auth.Credentials | None = None  # the client key this driver connects with
        self._owns_ray = owns_ray

    def connect(self, **options: Any) -> Client:
        """A client of this coordinator with this driver's key: ``async with cluster.connect():``."""
        return Client(self.address, credentials=self.credentials, **options)

    def client_env(self) -> dict[str, str]:
        """The environment another client process of this coordinator needs (its admin key)."""
        if self.keys is None:
            return {}
        return {
            "PLEXRL_KEY": str(self.keys / "secret" / f"{ADMIN_KEY}.key_secret"),
            "PLEXRL_COORDINATOR_KEY": str(self.keys / "coordinator.key"),
        }

    def check(self, timeout_s: float = 30.0) -> None:
        """Raise :class:`RayClusterError` if the coordinator actor is gone (it is not restarted:
        its address would change under its clients)."""
        if self.coordinator is None:
            return
        import ray

        try:
            ray.get(self.coordinator.pid.remote(), timeout=timeout_s)
        except ray.exceptions.RayError as e:
            raise RayClusterError(f"the coordinator at {self.address} is gone: {str(e).splitlines()[0]}") from None

    def down(self, timeout_s: float = 30.0) -> None:
        """Stop the workers, then the coordinator actor, then free their devices (each step bounded)."""
        import ray

        for group in (self.workers, [self.coordinator] if self.coordinator is not None else []):
            stops = [actor.stop.remote(timeout_s) for actor in group]
            for ref in stops:
                # An actor that died or is restarting has nothing to stop: it is killed next.
                with contextlib.suppress(ray.exceptions.RayError):
                    ray.get(ref, timeout=timeout_s + 10.0)
            for actor in group:
                ray.kill(actor, no_restart=True)
        self.workers, self.coordinator = [], None
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
        if self.keys is not None:
            shutil.rmtree(self.keys, ignore_errors=True)
            self.keys = None

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.down()

    async def __aenter__(self) -> RayCluster:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.down)


def up(
    address: str,
    *,
    devices: int | None = None,
    coordinator: str | None = None,
    port: int = 0,
    policy: str = "fifo",
    sampler: str | None = None,
    cpus_per_worker: int = 1,
    coordinator_cpus: float = 1.0,
    worker_args: Sequence[str] = (),
    coordinator_args: Sequence[str] = (),
    worker_key: str | os.PathLike[str] | None = None,
    coordinator_key: str | os.PathLike[str] | None = None,
    credentials: auth.Credentials | None = None,
    max_restarts: int = -1,
    start_timeout_s: float = 300.0,
) -> RayCluster:
    """Bring plexrl up on the Ray cluster at ``address`` (``"head:6379"``, ``"auto"``) and return
    once every worker has registered; blocking (from async code: ``await asyncio.to_thread(up, ...)``).

    - ``devices``: workers to run. On a cluster with GPUs: one per GPU, all of them by default.
      On a CPU-only cluster: one per ``cpus_per_worker`` CPUs, by default as many as the cluster's
      CPUs hold after ``coordinator_cpus`` (the coordinator actor's share).
    - ``coordinator``: the endpoint of a coordinator already running (``"tcp://head:7400"``);
      workers register there with ``worker_key`` (a ``NAME.key_secret`` file of its key directory)
      and ``coordinator_key`` (its ``coordinator.key``), or with none when it serves ``--insecure``;
      this driver checks on them with ``credentials`` (default ``$PLEXRL_KEY`` /
      ``$PLEXRL_COORDINATOR_KEY``). Without it, a coordinator actor serves ``port`` (0: a free one)
      on its node with a key directory made for this run (``cluster.client_env()``).
    - ``policy``, ``coordinator_args``: the coordinator actor's ``plexrl coordinator`` options;
      ``sampler``, ``worker_args``: every worker's ``plexrl worker`` options.
    - ``max_restarts``: how often Ray restarts each worker after it dies (-1: always).
    - ``start_timeout_s``: the deadline for all of it; :class:`RayClusterError` after it.

    If this process called ``ray.init`` already, that connection is used (and left open by ``down``).
    """
    ray = _import_ray()
    deadline = time.monotonic() + start_timeout_s
    if coordinator is not None and (coordinator_args or port or policy != "fifo"):
        raise InvalidRequestError("port, policy and coordinator_args configure a coordinator actor: pass them to "
                                  "the coordinator you named with `plexrl coordinator` instead")  # fmt: skip
    owns_ray = not ray.is_initialized()
    if owns_ray:
        _check_reachable(address)
        try:
            ray.init(address=address, log_to_driver=True)  # the actors' logs (plexrl's) reach this process
        except ConnectionError as e:
            raise RayClusterError(f"no Ray cluster at {address!r} ({e}): start one with `ray start --head`") from None
    cluster = RayCluster(address, owns_ray=owns_ray)
    try:
        resources = ray.cluster_resources()
        count = _device_count(resources, devices, cpus_per_worker, coordinator_cpus, coordinator)
        if coordinator is None:
            _start_coordinator(ray, cluster, port, policy, coordinator_args, coordinator_cpus, deadline)
        else:
            cluster.address = coordinator
            cluster.credentials = credentials if credentials is not None else auth.Credentials.from_env()
        worker_files, key_args = _worker_keys(cluster, worker_key, coordinator_key)
        before = len(_run_async(_status(cluster, 0, _left(deadline))).workers)
        options = [*key_args, *(["--sampler", sampler] if sampler else []), *worker_args]
        _start_workers(ray, cluster, count, gpu=resources.get("GPU", 0) >= 1, cpus_per_worker=cpus_per_worker, max_restarts=max_restarts,
                       options=options, files=worker_files, deadline=deadline)  # fmt: skip
        _run_async(_status(cluster, before + count, _left(deadline)))
    except BaseException:
        cluster.down()
        raise
    return cluster


def _import_ray() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise InvalidRequestError("plexrl on Ray needs Ray: pip install 'plexrl[ray]'") from None
    return ray


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on an address nothing listens at: ``ray.init`` would retry for minutes."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if address == "auto" or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise RayClusterError(
            f"nothing answers at the Ray address {address} ({e}): start a cluster with `ray start --head --port "
            f"{port}`, or pass the head's address as `ray status` prints it"
        ) from None


def _device_count(
    resources: dict[str, float], devices: int | None, cpus_per_worker: int, coordinator_cpus: float, given: str | None
) -> int:
    """Workers to start: ``devices``, checked against the cluster's GPUs (or CPUs, on a CPU-only one)."""
    gpus = int(resources.get("GPU", 0))
    if gpus:
        have, what = gpus, f"{gpus} GPU(s)"
    else:
        if cpus_per_worker < 1:
            raise InvalidRequestError(f"cpus_per_worker={cpus_per_worker}: give a worker at least one CPU")
        spare = resources.get("CPU", 0) - (0 if given else coordinator_cpus)
        have, what = int(spare // cpus_per_worker), f"{resources.get('CPU', 0):g} CPU(s), no GPU"
        what += f", of which the coordinator takes {coordinator_cpus:g}" if not given else ""
    if devices is not None and devices < 1:
        raise InvalidRequestError(f"devices={devices}: run at least one worker")
    count = have if devices is None else devices
    if count < 1 or count > have:
        per = "" if gpus else f" of {cpus_per_worker} CPU(s) each"
        raise InvalidRequestError(
            f"the Ray cluster has {what}: room for {have} worker(s){per}, not {count}; ask for fewer devices "
            "or add nodes"
        )
    return count


def _start_coordinator(
    ray: ModuleType,
    cluster: RayCluster,
    port: int,
    policy: str,
    extra: Sequence[str],
    cpus: float,
    deadline: float,
) -> None:
    """A coordinator actor (not restarted: its clients know it by its address) with a key directory
    made for this run: the coordinator's pair, one worker key, and this driver's admin key."""
    cluster.keys = Path(tempfile.mkdtemp(prefix="plexrl-ray-keys-"))  # mode 0700
    auth.init_dir(cluster.keys)
    auth.add_key(cluster.keys, WORKER_KEY, "worker")
    auth.add_key(cluster.keys, ADMIN_KEY, "admin")
    env = cluster.client_env()
    cluster.credentials = auth.Credentials.load(env["PLEXRL_KEY"], env["PLEXRL_COORDINATOR_KEY"])
    # The directory but its issued secret keys (those stay with their holders), its allowlist folders included.
    files = {f"{folder}/": b"" for folder in auth.FOLDERS.values()}
    files |= {str(p.relative_to(cluster.keys)): p.read_bytes() for p in cluster.keys.rglob("*.key*")
              if p.parent.name != "secret"}  # fmt: skip
    args = ["coordinator", "--bind", f"tcp://{{node_ip}}:{port}", "--keys", "{files}", "--print-address",
            "--policy", policy, *extra]  # fmt: skip
    actor_class = ray.remote(PlexrlProcess)
    cluster.coordinator = actor_class.options(num_cpus=cpus, max_restarts=0).remote(args, files, True)
    cluster.address = _get(ray, cluster.coordinator.address.remote(), deadline, "the coordinator actor to start")


def _worker_keys(
    cluster: RayCluster, worker_key: str | os.PathLike[str] | None, coordinator_key: str | os.PathLike[str] | None
) -> tuple[dict[str, bytes], list[str]]:
    """The key files every worker actor writes, and the ``plexrl worker`` options naming them."""
    if cluster.keys is not None:
        worker_key = cluster.keys / "secret" / f"{WORKER_KEY}.key_secret"
        coordinator_key = cluster.keys / "coordinator.key"
    if worker_key is None and coordinator_key is None:
        return {}, []
    if worker_key is None or coordinator_key is None:
        raise InvalidRequestError("pass both worker_key (a NAME.key_secret) and coordinator_key (coordinator.key)")
    auth.load_pair(worker_key)  # refuses a missing key or one that others can read, here rather than on every node
    files = {"worker.key_secret": Path(worker_key).read_bytes(), "coordinator.key": Path(coordinator_key).read_bytes()}
    return files, ["--key", "{files}/worker.key_secret", "--coordinator-key", "{files}/coordinator.key"]


def _start_workers(
    ray: ModuleType,
    cluster: RayCluster,
    count: int,
    *,
    gpu: bool,
    cpus_per_worker: int,
    max_restarts: int,
    options: list[str],
    files: dict[str, bytes],
    deadline: float,
) -> None:
    """One placement-group bundle per device, one worker actor (``plexrl worker ... options``) in each."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle: dict[str, float] = {"GPU": 1} if gpu else {"CPU": cpus_per_worker}
    cluster.placement_group = placement_group([dict(bundle) for _ in range(count)])
    _get(ray, cluster.placement_group.ready(), deadline, f"{count} bundle(s) of {bundle} to be free")
    # Ray gives a GPU actor its GPU as CUDA_VISIBLE_DEVICES: it is cuda:0 to the worker.
    device = ["--device", "cuda:0"] if gpu else ["--device", "cpu", "--threads", str(cpus_per_worker)]
    actor_class = ray.remote(PlexrlProcess)
    for i in range(count):
        command = ["worker", "--coordinator", cluster.address, "--name", f"ray-{i}", *device, *options]
        strategy = PlacementGroupSchedulingStrategy(cluster.placement_group, placement_group_bundle_index=i)
        actor = actor_class.options(
            num_gpus=1 if gpu else 0,
            num_cpus=0 if gpu else cpus_per_worker,
            max_restarts=max_restarts,
            scheduling_strategy=strategy,
        ).remote(command, files, False)
        cluster.workers.append(actor)
    _get(ray, [w.pid.remote() for w in cluster.workers], deadline, "the worker actors to start")


def _get(ray: ModuleType, refs: Any, deadline: float, what: str) -> Any:
    """``ray.get`` until the deadline; a :class:`RayClusterError` saying what did not happen."""
    try:
        return ray.get(refs, timeout=_left(deadline))
    except ray.exceptions.GetTimeoutError:
        raise RayClusterError(f"timed out waiting for {what}; see the actors' logs above") from None
    except ray.exceptions.RayActorError as e:
        raise RayClusterError(f"an actor died while waiting for {what}: {e}") from None


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


async def _status(cluster: RayCluster, min_workers: int, timeout_s: float) -> Any:
    """The coordinator's status once ``min_workers`` workers have registered, within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s), cluster.connect(connect_timeout_s=timeout_s) as client:
            return await client.status(min_workers=min_workers)
    except TimeoutError:
        raise RayClusterError(
            f"{min_workers} worker(s) did not register with {cluster.address} in time; see their logs above"
        ) from None


def _run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end from blocking code: here (a script, the CLI: Ctrl-C cancels it), or
    on a loop of its own in a thread when this thread runs a loop already (``up`` called from a coroutine)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plexrl-ray") as pool:
        return pool.submit(asyncio.run, coro).result()
