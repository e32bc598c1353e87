"""The ``plexrl`` command: coordinator | worker | local | up | status | keys."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import logging
import os
import re
import select
import signal
import sys
import threading
import time

from plexrl.coordinator.buckets import Mlfq
from plexrl.errors import InvalidRequestError
from plexrl.names import ENGINE_SLEEP
from plexrl.protocol import auth
from plexrl.protocol.codec import DEFAULT_MAX_MESSAGE_BYTES


def _die_with_parent(parent_pid: int | None) -> None:
    """Embedded children must not outlive the script that started them, even after SIGKILL."""
    if parent_pid is None:
        return
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        sys.exit(0)
    threading.Thread(target=_exit_after_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()


ORPHAN_GRACE_S = 5.0  # after its parent died: how long a clean shutdown (the SIGTERM above) may take


def _exit_after_parent(parent_pid: int) -> None:
    """End the process ``ORPHAN_GRACE_S`` after its parent died, if the SIGTERM did not: a shutdown
    that hangs must not leave an orphan holding the script's pipes and ports."""
    try:
        fd = os.pidfd_open(parent_pid)
    except (OSError, AttributeError):  # no pidfd (old kernel, not Linux): look once a second
        while os.getppid() == parent_pid:
            time.sleep(1.0)
    else:
        select.select([fd], [], [])  # readable once the parent has exited
        os.close(fd)
    time.sleep(ORPHAN_GRACE_S)
    logging.getLogger(__name__).error("still running %.0f s after the parent died: exiting", ORPHAN_GRACE_S)
    os._exit(1)


def _device(value: str) -> str:
    if value == "cpu" or re.fullmatch(r"cuda:\d+", value):
        return value
    raise argparse.ArgumentTypeError(f"device {value!r} must be 'cpu' or 'cuda:N'")


def _device_index(device: str) -> int:
    """cuda:N's N; 0 for the CPU."""
    return int(device.split(":")[1]) if device.startswith("cuda:") else 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING, ...)")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES, help="largest message accepted")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plexrl", description="Run many RL jobs on one shared set of accelerators.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("coordinator", help="run the shared coordinator")
    p.add_argument("--bind", default="tcp://127.0.0.1:7400", help="endpoint to listen on (port 0 = any free port)")
    p.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds between heartbeats")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port of --bind's host (0: a free one, logged)")  # fmt: skip
    p.add_argument("--heartbeat-liveness", type=int, default=5, help="silent intervals before a peer is dead")
    p.add_argument(
        "--weights-via",
        choices=["workers", "coordinator"],
        default="workers",
        help="how a job's new weights reach its other workers: fetched from its home worker's data plane "
        "(default), or through the coordinator in the calls' messages (the baseline bench/weights.py measures)",
    )
    p.add_argument("--client-timeout", type=float, default=30.0, help="seconds a silent client keeps its jobs running")
    p.add_argument(
        "--client-grace",
        type=float,
        default=300.0,
        help="seconds a silent client's jobs stay suspended for `client.reattach(name)` before they are closed",
    )
    p.add_argument(
        "--snapshot-max-bytes",
        type=int,
        default=32 << 20,
        help="jobs whose state is at most this survive their worker's death (snapshots kept here); 0: none do",
    )
    p.add_argument(
        "--recovery-wait",
        type=float,
        default=300.0,
        help="seconds such a job whose worker died waits for another worker to take it before its calls fail",
    )
    p.add_argument(
        "--journal",
        help="a file (SQLite) recording jobs: a coordinator started again with it resumes them "
        "(jobs within --snapshot-max-bytes; their clients reconnect by themselves)",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=600.0,
        help="seconds a worker may run a call without engine progress before it is declared hung (0: never)",
    )
    p.add_argument(
        "--gang-timeout",
        type=float,
        default=120.0,
        help="seconds a job on several workers (devices=N) waits for its members in a collective before its "
        "call fails and the job is rebuilt from its snapshot (below --hang-timeout)",
    )
    p.add_argument(
        "--max-calls-per-tenant", type=int, default=20_000, help="calls one key may have queued or running at once"
    )
    p.add_argument(
        "--max-bytes-per-tenant",
        type=parse_bytes,
        default=16 << 30,
        help="bytes of messages one key's queued and running calls may hold, e.g. 16GiB",
    )
    _policy(p)
    p.add_argument(
        "--elastic",
        action="store_true",
        help="Libra's elastic roles, both ways: train workers whose pooled jobs roll out lend themselves to "
        "rollout until those jobs train again, and idle rollout workers join a recoverable pooled job's "
        "training (data parallel) from one optimizer step to a later one",
    )
    p.add_argument(
        "--move-prior",
        type=float,
        default=1.0,
        help="with --elastic: seconds a worker's move between roles (or a join of a job's training) is expected "
        "to take until measured",
    )
    p.add_argument(
        "--level-peers",
        type=_increasing,
        default=Mlfq().peer_ratios,
        help="pooled jobs' trajectories: a level down at each of these ratios of its tokens since its prompt "
        "to its job's other trajectories' at the same turn (comma-separated, increasing; 'off': none)",
    )
    p.add_argument(
        "--level-service",
        type=_increasing,
        default=Mlfq().service_s,
        help="pooled jobs' trajectories: a level down at each of these seconds of service its turns received "
        "(comma-separated, increasing; default off: seconds depend on the hardware)",
    )
    p.add_argument("--print-address", action="store_true", help="print the bound endpoint on stdout once ready")
    p.add_argument("--keys", default=None, help="key directory (`plexrl keys init DIR`): authenticate every peer")
    p.add_argument(
        "--insecure", action="store_true", help="serve without authentication (refused unless --bind is loopback)"
    )
    _common(p)

    p = sub.add_parser("worker", help="run a worker for one accelerator")
    p.add_argument("--coordinator", required=True, help="the coordinator's endpoint, e.g. tcp://head:7400")
    p.add_argument("--device", type=_device, default="cpu", help="cpu or cuda:N")
    p.add_argument("--name", default="", help="a name shown in `plexrl status`")
    p.add_argument(
        "--data-host",
        default=None,
        help="the address other workers fetch this worker's published weights at (its data plane; default: "
        "this host's address on the route to the coordinator)",
    )
    p.add_argument(
        "--node",
        default=None,
        help="its host, for jobs that train on several workers at once (devices=N): a gang's workers share a "
        "node (default: this host's name on a GPU; none on CPU, where it takes one-device jobs only)",
    )
    p.add_argument(
        "--index",
        type=int,
        default=None,
        help="its device index on its node: a gang of N takes N workers whose indices are i..i+N-1, i a multiple "
        "of N (default: the GPU's index, else 0)",
    )
    _credentials(p, "worker")
    p.add_argument(
        "--checkpoint-root",
        default=None,
        help="where jobs' checkpoints go: save/load paths are relative to ROOT/<tenant> "
        "(default $XDG_DATA_HOME/plexrl/checkpoints, i.e. ~/.local/share/plexrl/checkpoints)",
    )
    _memory_budget(p, default=None)
    p.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        default="auto",
        help="the compute dtype of the trainer's frozen weights and forwards, of vLLM and of published adapters "
        "(trained weights and AdamW stay float32); auto: bfloat16 on a GPU, float32 on CPU",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=0.3,
        help="vllm on CUDA: the share of the GPU each engine reserves (its weights, LoRA slots and KV): one per "
        "base model's LoRA jobs, one per full fine-tune job; the memory plan counts it",
    )
    p.add_argument(
        "--engine-sleep",
        choices=ENGINE_SLEEP,
        default="auto",
        help="vllm: whether the engines sleep while this worker trains, giving their memory to training: auto "
        "(when a training call would not fit beside them; on a GPU only: on CPU a sleep frees nothing), always "
        "(around every training phase: on CPU they pause), never; the coordinator decides when, by the memory plan",
    )
    p.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=8192,
        help="vllm: the longest prompt + completion (capped at the model's context); longer prompts are refused",
    )
    p.add_argument(
        "--max-tokens-per-microbatch",
        type=_positive_int,
        default=8192,
        help="the trainer's padded tokens per forward/backward: a call's rows are cut into micro-batches of at "
        "most this many (a longer row goes alone), which bounds its activation memory",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="GPU workers: the same tokens for a seeded request whatever it is batched with, and the same "
        "gradients on a replay: vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT) and torch's deterministic "
        "algorithms (slower; see docs/architecture.md, Guarantees); a CPU worker is so without it",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--cpus",
        type=parse_cpus,
        default=None,
        help="CPU cores to pin the worker and its vLLM engine to, e.g. 1 or 2-3 (so that one worker stands "
        "for one device: two pinned workers never share a core); its torch threads default to their count",
    )
    p.add_argument(
        "--sampler",
        choices=["vllm", "hf"],
        default=None,
        help="generation engine: vllm (default where installed; $PLEXRL_SAMPLER overrides) or hf (transformers)",
    )
    p.add_argument(
        "--role",
        choices=["both", "rollout", "train"],
        default="both",
        help="what it serves: both (default: jobs' homes, their training and sampling), rollout (pooled jobs' "
        "turns only, never a home), train (homes only; pooled jobs' turns go to rollout workers)",
    )
    p.add_argument(
        "--bucket",
        type=_level,
        default=0,
        help="a rollout worker's bucket: the lowest trajectory level it serves (Libra; 0 serves every level "
        "without a bucket of its own; give larger-batch or faster workers higher buckets for long trajectories)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        choices=[1, 8, 16, 32, 64, 128, 256],
        default=8,
        help="vllm: the largest LoRA rank jobs may use (every adapter is padded to it; keep it small)",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=32,
        help="vllm: adapters one batch may mix (vLLM's max_loras); more tenants wait their turn in arrival order",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="vllm: the most sequences the engine decodes at once (vLLM's max_num_seqs; default vLLM's own); "
        "a small value makes a rollout hold more requests than slots, as on a busy rollout node",
    )
    _common(p)

    p = sub.add_parser("tinker", help="serve the Tinker SDK's HTTP API onto a coordinator (needs plexrl[tinker])")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--coordinator", help="the coordinator's endpoint, e.g. tcp://head:7400")
    where.add_argument("--local", action="store_true", help="on an embedded cluster of --workers workers instead")
    p.add_argument("--workers", type=int, default=1, help="--local: how many workers")
    p.add_argument("--sampler", choices=["vllm", "hf"], default=None, help="--local: the workers' generation engine")
    p.add_argument(
        "--tenants",
        default=None,
        help='JSON map of API keys to client key files, {"tml-alice": "alice.key_secret"}: each key\'s jobs '
        "are its own plexrl tenant's; others are refused (default: all on --key; --local issues one per key)",
    )
    _policy(p)
    p.add_argument(
        "--bind", default="127.0.0.1:8000", help="HOST:PORT to serve HTTP on (TINKER_BASE_URL=http://HOST:PORT)"
    )
    _credentials(p, "client")
    _common(p)

    p = sub.add_parser("local", help="run an embedded coordinator and workers until Ctrl-C")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--device", type=_device, default="cpu")
    _policy(p)
    _memory_budget(p, default=None)
    p.add_argument("--log-level", default="WARNING")

    p = sub.add_parser("up", help="run a coordinator and one worker per device on a Ray cluster until Ctrl-C")
    p.add_argument("--ray", required=True, metavar="ADDRESS", help="the Ray cluster's address, e.g. head:6379 or auto")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="workers to run: one per GPU (default: every GPU); on a CPU-only cluster one per --cpus-per-worker "
        "CPUs (default: as many as fit beside the coordinator)",
    )
    p.add_argument(
        "--coordinator",
        default=None,
        help="register the workers with this running coordinator (tcp://HOST:PORT; with --key as their worker "
        "key) instead of starting one as a Ray actor",
    )
    p.add_argument("--port", type=int, default=0, help="the coordinator actor's port on its node (0: a free one)")
    p.add_argument("--cpus-per-worker", type=int, default=1, help="CPU-only clusters: CPUs each worker reserves")
    p.add_argument("--sampler", choices=["vllm", "hf"], default=None, help="the workers' generation engine")
    _policy(p)
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds until every worker must have registered")
    _credentials(p, "worker")
    p.add_argument("--log-level", default="WARNING")

    p = sub.add_parser("status", help="show a coordinator's workers and jobs")
    p.add_argument("--coordinator", required=True)
    _credentials(p, "client")

    p = sub.add_parser("trace", help="write the coordinator's recent calls as a Chrome/Perfetto trace file")
    p.add_argument("--coordinator", required=True)
    p.add_argument("--out", default="plexrl-trace.json", help="the trace file (open it in ui.perfetto.dev)")
    p.add_argument("--png", default=None, help="also draw it into this picture (needs matplotlib)")
    _credentials(p, "client")

    p = sub.add_parser("top", help="a live view of a coordinator's workers, jobs, swaps and faults")
    p.add_argument("--coordinator", required=True)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    _credentials(p, "client")

    p = sub.add_parser("keys", help="make a key directory and issue keys to workers and clients")
    keys = p.add_subparsers(dest="keys_command", required=True)
    k = keys.add_parser("init", help="a new key directory: the coordinator's key pair, empty allowlists")
    k.add_argument("dir")
    k = keys.add_parser("add", help="issue a key: its secret file to hand out, its public half on the allowlist")
    k.add_argument("dir")
    k.add_argument("name", help="who holds it, e.g. worker-gpu3 or alice")
    k.add_argument("--role", choices=["worker", "client", "admin"], required=True)

    return parser


def _credentials(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--key", default=None, help=f"your {role} key, a NAME.key_secret file ($PLEXRL_KEY)")
    p.add_argument("--coordinator-key", default=None, help="the coordinator's public key, DIR/coordinator.key "
                   "($PLEXRL_COORDINATOR_KEY)")  # fmt: skip


def _load_credentials(args: argparse.Namespace) -> auth.Credentials | None:
    if args.key or args.coordinator_key:
        if not (args.key and args.coordinator_key):
            raise InvalidRequestError("pass both --key (your NAME.key_secret) and --coordinator-key (coordinator.key)")
        return auth.Credentials.load(args.key, args.coordinator_key)
    return auth.Credentials.from_env()


def _policy(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--policy",
        default="fifo",
        choices=["fifo", "dedicated", "plex"],
        help="scheduling policy: fifo (share workers, oldest call first), dedicated (one job per worker), "
        "plex (multiplex jobs: pack devices, resident state first, fair share, swaps only when they pay)",
    )


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number >= 1")
    return int(text)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number in (0, 1], e.g. 0.3") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number in (0, 1], e.g. 0.3")
    return value


def _level(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: a bucket is a trajectory level, an integer >= 0")
    return int(text)


def _increasing(text: str) -> tuple[float, ...]:
    """Thresholds: positive numbers separated by commas, increasing; 'off' (or nothing): none."""
    if text.strip().lower() in ("", "off"):
        return ()
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give numbers separated by commas, e.g. 2,8,32, or 'off'") from None
    if any(not v > 0 for v in values) or list(values) != sorted(values):
        raise argparse.ArgumentTypeError(f"{text!r}: the numbers must be > 0 and increasing, e.g. 2,8,32")
    return values


def _memory_budget(p: argparse.ArgumentParser, default: int | None) -> None:
    p.add_argument(
        "--memory-budget",
        type=parse_bytes,
        default=default,
        help="at most this much device memory for jobs' state, e.g. 40GiB, 512MiB, 2e6 (default: what the memory "
        "plan leaves of the device once base models, engines and activation headroom are counted)",
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        return _run(args)
    except InvalidRequestError as e:  # a setting to change: say which, without a traceback
        print(f"plexrl {args.command}: {e.message}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "keys":
        return _keys(args)
    if args.command == "coordinator":
        return _coordinator(args)
    if args.command == "worker":
        return _worker(args)
    if args.command == "local":
        return asyncio.run(_local(args))
    if args.command == "tinker":
        return _tinker(args)
    if args.command == "up":
        return _up(args)
    if args.command == "status":
        return asyncio.run(_status(args))
    if args.command == "trace":
        return asyncio.run(_trace(args))
    if args.command == "top":
        from plexrl.client import top

        if not args.interval > 0:
            raise InvalidRequestError(f"--interval {args.interval}: give a number of seconds > 0")
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: the way out
            asyncio.run(top.run(args.coordinator, _load_credentials(args), args.interval))
        return 0
    raise AssertionError(args.command)


def _coordinator(args: argparse.Namespace) -> int:
    from plexrl.coordinator.server import CoordinatorConfig, run_coordinator

    _die_with_parent(args.parent_pid)
    if args.keys is None and not args.insecure:
        raise InvalidRequestError(
            "pass --keys DIR to authenticate workers and clients (make DIR with `plexrl keys init DIR`), "
            "or --insecure to serve a loopback address without authentication"
        )
    if args.keys is not None and args.insecure:
        raise InvalidRequestError("--keys and --insecure exclude each other")
    config = CoordinatorConfig(
        keys=args.keys,
        client_timeout_s=args.client_timeout,
        client_grace_s=args.client_grace,
        hang_timeout_s=args.hang_timeout,
        gang_timeout_s=args.gang_timeout,
        snapshot_max_bytes=args.snapshot_max_bytes,
        recovery_wait_s=args.recovery_wait,
        journal=args.journal,
        max_calls_per_tenant=args.max_calls_per_tenant,
        max_bytes_per_tenant=args.max_bytes_per_tenant,
        bind=args.bind,
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_liveness=args.heartbeat_liveness,
        max_message_bytes=args.max_message_bytes,
        policy=args.policy,
        elastic=args.elastic,
        move_prior_s=args.move_prior,
        level_peer_ratios=args.level_peers,
        level_service_s=args.level_service,
        metrics_port=args.metrics_port,
        weights_via=args.weights_via,
    )

    def ready(address: str) -> None:
        if args.print_address:
            print(address, flush=True)

    asyncio.run(run_coordinator(config, ready))
    return 0


def _worker(args: argparse.Namespace) -> int:
    from plexrl.worker.devices import isolate
    from plexrl.worker.server import WorkerConfig, default_sampler, run_worker

    _die_with_parent(args.parent_pid)
    try:  # before torch or vLLM start CUDA: the worker's GPU is the only one it sees
        device = isolate(args.device)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    if args.deterministic and device.startswith("cuda"):
        # Read by vLLM (its engine processes too) and cuBLAS as they start. vLLM's batch-invariant
        # kernels are Triton kernels, GPU only: a CPU worker's engine is batch-invariant as it is
        # (its kernels do not split a row's reductions by batch size; the tests check the tokens).
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Idle OpenMP threads spinning after each op would steal the cores that the coordinator,
    # the clients and other workers need between calls. Must be set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    threads = args.threads
    if args.cpus:
        # Before torch and vLLM start: the engine's processes inherit the mask, and vLLM's CPU
        # backend binds its OpenMP threads to the cores this variable lists.
        os.sched_setaffinity(0, args.cpus)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, args.cpus))
        os.environ["OMP_NUM_THREADS"] = str(threads or len(args.cpus))
        threads = threads or len(args.cpus)
    if threads:
        import torch

        torch.set_num_threads(threads)
    config = WorkerConfig(
        coordinator=args.coordinator,
        device=device,
        name=args.name or (f"{os.uname().nodename}:{args.device}" if device.startswith("cuda") else ""),
        memory_budget_bytes=args.memory_budget,
        max_message_bytes=args.max_message_bytes,
        sampler=args.sampler or default_sampler(),
        max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras,
        max_num_seqs=args.max_num_seqs,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        engine_sleep=args.engine_sleep,
        max_model_len=args.max_model_len,
        max_tokens_per_microbatch=args.max_tokens_per_microbatch,
        deterministic=args.deterministic,
        role=args.role,
        bucket=args.bucket,
        credentials=_load_credentials(args),
        data_host=args.data_host,
        node=args.node if args.node is not None else (os.uname().nodename if device.startswith("cuda") else ""),
        index=args.index if args.index is not None else _device_index(device),
        **({"checkpoint_root": args.checkpoint_root} if args.checkpoint_root else {}),
    )
    run_worker(config)
    return 0


def _tinker(args: argparse.Namespace) -> int:
    host, _, port = args.bind.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidRequestError(f"--bind {args.bind!r}: give HOST:PORT, e.g. 127.0.0.1:8000")
    try:
        from plexrl.gateway import serve_coordinator, serve_local, serve_tenants
    except ImportError as e:
        raise InvalidRequestError(f"the Tinker gateway needs its extra: pip install 'plexrl[tinker]' ({e})") from None
    _die_with_parent(args.parent_pid)
    if args.local and args.tenants:
        raise InvalidRequestError("--local issues a tenant key per API key itself: drop --tenants")
    if args.local:
        asyncio.run(serve_local(host, int(port), workers=args.workers, sampler=args.sampler, policy=args.policy))
    elif args.tenants is None:
        asyncio.run(serve_coordinator(args.coordinator, host, int(port), _load_credentials(args)))
    else:
        coordinator_key = args.coordinator_key or os.environ.get("PLEXRL_COORDINATOR_KEY")
        if not coordinator_key:
            raise InvalidRequestError("--tenants needs the coordinator's public key: pass --coordinator-key")
        public = auth.load_public(coordinator_key)
        asyncio.run(serve_tenants(args.coordinator, host, int(port), args.tenants, public))
    return 0


async def _local(args: argparse.Namespace) -> int:
    from plexrl.client.local import LocalCluster

    cluster = LocalCluster(
        args.workers,
        device=args.device,
        log_level=args.log_level,
        policy=args.policy,
        memory_budget_bytes=args.memory_budget,
    )
    async with cluster as cluster_client:
        env = " ".join(f"{k}={v}" for k, v in cluster.client_env().items())
        print(
            f"plexrl embedded cluster with {args.workers} worker(s) at {cluster_client.address}; Ctrl-C to stop\n"
            f"other clients: {env}",
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    return 0


def _up(args: argparse.Namespace) -> int:
    from plexrl import ray as plexrl_ray

    if args.coordinator is None and (args.key or args.coordinator_key):
        raise InvalidRequestError(
            "--key and --coordinator-key go with --coordinator: the coordinator actor makes its own"
        )
    try:
        cluster = plexrl_ray.up(
            args.ray,
            devices=args.devices,
            coordinator=args.coordinator,
            port=args.port,
            policy=args.policy,
            sampler=args.sampler,
            cpus_per_worker=args.cpus_per_worker,
            worker_key=args.key,
            coordinator_key=args.coordinator_key,
            start_timeout_s=args.start_timeout,
            worker_args=["--log-level", args.log_level],
        )
    except plexrl_ray.RayClusterError as e:
        print(f"plexrl up: {e.message}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with cluster:
        env = " ".join(f"{k}={v}" for k, v in cluster.client_env().items())
        print(
            f"plexrl on the Ray cluster at {args.ray}: {len(cluster.workers)} worker(s), coordinator {cluster.address}; "
            f"Ctrl-C to stop\nclients: plexrl.connect({cluster.address!r}) or --coordinator {cluster.address}"
            + (f" with {env}" if env else ""),
            flush=True,
        )
        while not stop.wait(timeout=5.0):  # and watch the coordinator, which Ray does not restart
            try:
                cluster.check()
            except plexrl_ray.RayClusterError as e:
                print(f"plexrl up: {e.message}", file=sys.stderr)
                return 1
    return 0


async def _trace(args: argparse.Namespace) -> int:
    from plexrl.client.connection import Client
    from plexrl.trace import chrome_trace, plot

    async with Client(args.coordinator, connect_timeout_s=10.0, credentials=_load_credentials(args)) as client:
        reply = await client.trace()
    with open(args.out, "w") as f:
        json.dump(chrome_trace(reply.spans, title=args.coordinator), f)
    older = f" ({reply.dropped} older calls no longer kept)" if reply.dropped else ""
    print(f"{len(reply.spans)} calls{older} -> {args.out} (open it in ui.perfetto.dev or chrome://tracing)")
    if args.png:
        plot(reply.spans, args.png, title=args.coordinator)
        print(f"-> {args.png}")
    return 0


async def _status(args: argparse.Namespace) -> int:
    from plexrl.client import views
    from plexrl.client.connection import Client

    async with Client(args.coordinator, connect_timeout_s=10.0, credentials=_load_credentials(args)) as client:
        st = await client.status()
    print(f"coordinator {args.coordinator}  up {st.uptime_s:.0f} s")
    print(views.plain(views.WORKER_COLUMNS, views.worker_rows(st)))
    print(views.plain(views.JOB_COLUMNS, views.job_rows(st)))
    return 0


def _keys(args: argparse.Namespace) -> int:
    if args.keys_command == "init":
        auth.init_dir(args.dir)
        print(f"key directory {args.dir}: give peers {args.dir}/coordinator.key; issue keys with "
              f"`plexrl keys add {args.dir} NAME --role worker|client|admin`")  # fmt: skip
        return 0
    secret = auth.add_key(args.dir, args.name, args.role)
    print(
        f"{args.role} key {args.name}: hand {secret} (secret, mode 0600) and {args.dir}/coordinator.key to its holder"
    )
    return 0


def parse_cpus(text: str) -> list[int]:
    """``'1'``, ``'0,2'``, ``'2-3'`` -> sorted core ids, each one this process may run on."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a CPU list: write core ids like 1, 0,2 or 2-3") from None
    allowed = os.sched_getaffinity(0)
    if not cores or not cores <= allowed:
        raise argparse.ArgumentTypeError(
            f"CPU list {text!r} names cores this machine does not offer here; allowed: {','.join(map(str, sorted(allowed)))}"
        )
    return sorted(cores)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """``'80GiB'``, ``'512MB'``, ``'2e6'`` -> bytes."""
    import re

    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    try:
        if match is None or unit not in _UNITS:
            raise ValueError
        value = float(match.group(1)) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: write a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB)"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be >= 0")
    return int(value)
