"""What each member process of the gang tests runs (importable by spawned processes)."""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

from plexrl.errors import GangBrokenError
from plexrl.protocol.messages import GangCall
from plexrl.worker.gang import Gang, Stores

_stores: Stores | None = None


def pool(members: int = 2) -> ProcessPoolExecutor:
    """Member processes (torch on one thread each), reused by a module's tests."""
    return ProcessPoolExecutor(members, mp_context=multiprocessing.get_context("spawn"), initializer=_init)


def _init() -> None:
    torch.set_num_threads(1)


def stores() -> Stores:
    global _stores
    if _stores is None:
        _stores = Stores()
    return _stores


def call(rank: int, store: str, token: str, *, epoch: int = 0, world: int = 2, timeout_s: float = 20.0) -> GangCall:
    return GangCall(epoch=epoch, rank=rank, world=world, store=store, token=token, timeout_s=timeout_s)


def open_gang(spec: GangCall) -> Gang:
    return Gang(spec, stores().get(spec.store, spec.timeout_s), torch.device("cpu"))


def collectives(spec: GangCall) -> dict[str, Any]:
    """Each collective once; what this member ends with."""
    gang = open_gang(spec)
    try:
        summed = [torch.full((3,), float(spec.rank + 1)), torch.arange(4, dtype=torch.float64) * (spec.rank + 1)]
        gang.all_reduce_(summed)
        sent = torch.arange(5, dtype=torch.float32) if spec.rank == 0 else torch.zeros(5)
        gang.broadcast_([sent])
        gathered = gang.all_gather_bytes(b"member %d " % spec.rank * (spec.rank + 1))
        return {"summed": [t.tolist() for t in summed], "sent": sent.tolist(), "gathered": gathered}
    finally:
        gang.close()


def two_gangs(first: GangCall, second: GangCall) -> list[float]:
    """Two gangs over the same members; the first closed, then the second still sums."""
    a, b = open_gang(first), open_gang(second)
    x = torch.ones(2)
    a.all_reduce_([x])
    a.close()
    y = torch.full((2,), 10.0)
    b.all_reduce_([y])
    b.close()
    return x.tolist() + y.tolist()


def alone(spec: GangCall) -> str:
    """Join a gang whose other member never comes; what it raises."""
    try:
        open_gang(spec)
    except GangBrokenError as e:
        return str(e)
    return "joined"


def killed_peer(spec: GangCall) -> str:
    """Rank 1 dies in the middle of the second all-reduce; rank 0 says what it saw and when."""
    gang = open_gang(spec)
    gang.all_reduce_([torch.ones(1)])
    if spec.rank == 1:
        os._exit(9)
    try:
        gang.all_reduce_([torch.ones(1)])
    except GangBrokenError as e:
        try:
            gang.all_reduce_([torch.ones(1)])
        except GangBrokenError as again:
            return f"{e} | {again}"
    return "summed"


def grpo_batches(steps: int, rows: int = 6, seed: int = 0) -> list[Any]:
    """``steps`` GRPO batches of ``rows`` rows of mixed lengths (some with advantage 0), with
    sampler logprobs: what a gang's members and one worker both train on."""
    import numpy as np

    from plexrl.types import Batch, Ragged

    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        lengths = rng.integers(4, 14, size=rows)
        tokens = [rng.integers(3, 60, size=int(n)).tolist() for n in lengths]
        prompt = np.full(rows, 3, np.int32)
        logprobs = [(-rng.random(int(n) - 3) - 0.5).tolist() for n in lengths]
        advantages = rng.normal(size=rows).astype(np.float32)
        advantages[rng.integers(rows)] = 0.0
        batches.append(
            Batch(
                tokens=Ragged.from_rows(tokens, "int32"),
                prompt_lens_B=prompt,
                sampler_logprobs=Ragged.from_rows(logprobs, "float32"),
                advantages_B=advantages,
            )
        )
    return batches


def train(
    model: str, lora: bool, batches: list[Any], gang: GangCall | None, kl_coef: float = 0.0, move: bool = False
) -> dict[str, Any]:
    """Open a job and run forward_backward + optim_step on each batch (as one gang member, or
    alone): the losses, token counts, grad norms, logprobs and final weights it ends with.
    ``move``: its state goes to host memory and back between each forward_backward and optim_step."""

    from plexrl.protocol.calls import ForwardBackward, JobSpec, Logprobs, Open, OptimStep
    from plexrl.types import AdamW, LoRA, LossConfig
    from plexrl.worker.engine import Engine
    from plexrl.worker.trainer.forward import TrainerSettings

    # Small micro-batches, so a call runs several passes and the members' counts differ.
    engine = Engine(trainer=TrainerSettings(max_tokens_per_microbatch=24))
    engine._stores = stores()
    spec = JobSpec(model=model, lora=LoRA(rank=4) if lora else None, optimizer=AdamW(lr=1e-2), seed=3)
    engine.execute("job", Open(spec=spec), gang)
    out: dict[str, Any] = {"loss": [], "num_tokens": [], "grad_norm": [], "metrics": []}
    config = LossConfig(kl_coef=kl_coef)
    for batch in batches:
        done = engine.execute("job", ForwardBackward(batch=batch, loss="grpo", loss_config=config), gang)
        out["loss"].append(done.loss)
        out["num_tokens"].append(done.num_tokens)
        out["metrics"].append(done.metrics)
        if move:
            engine.move("job", "host")
            shards = [p.to_local() for p in engine._jobs["job"].weights.trainer_params.values()]
            out.setdefault("emptied", []).append(all(t.untyped_storage().nbytes() == 0 for t in shards))
            engine.move("job", "device")
        out["grad_norm"].append(engine.execute("job", OptimStep(), gang).grad_norm)
    out["logprobs"] = engine.execute("job", Logprobs(tokens=batches[0].tokens), gang).logprobs.values
    job = engine._jobs["job"]
    out["weights"] = {k: t.cpu().numpy() for k, t in job._trained().items()}
    engine.close()
    return out


def elastic(model: str, batches: list[Any], role: str, store: str, snapshot_dir: str) -> dict[str, Any]:
    """A LoRA job's three steps, data parallel for the second only (``role``): "home" runs all
    three, alone, then with a joiner, then alone again; "joiner" joins for step 2 from the home's
    snapshot after step 1 (``Restore``, as the coordinator sends it) and leaves (``Close``) after
    it; "alone" runs all three on one worker."""
    import pickle

    from plexrl.protocol.calls import Close, ForwardBackward, JobSpec, Open, OptimStep, Restore
    from plexrl.types import AdamW, LoRA, LossConfig
    from plexrl.worker.engine import Engine
    from plexrl.worker.trainer.forward import TrainerSettings

    engine = Engine(trainer=TrainerSettings(max_tokens_per_microbatch=24))
    engine._stores = stores()
    spec = JobSpec(model=model, lora=LoRA(rank=4), optimizer=AdamW(lr=1e-2), seed=3)
    opening = Open(spec=spec, snapshot_max_bytes=1 << 30)
    snapshot_path = f"{snapshot_dir}/snapshot.pickle"
    wide = {"home": call(0, store, "elastic"), "joiner": call(1, store, "elastic")}.get(role)

    def step(batch: Any, gang: GangCall | None) -> Any:
        engine.execute("job", ForwardBackward(batch=batch, loss="grpo", loss_config=LossConfig()), gang)
        return engine.execute("job", OptimStep(snapshot=gang is None), gang)

    if role == "joiner":
        deadline = time.monotonic() + 120
        while not os.path.exists(snapshot_path):  # the home's first step (a test helper: no coordinator here)
            if time.monotonic() > deadline:
                raise TimeoutError("the home never wrote its snapshot")
            time.sleep(0.05)
        with open(snapshot_path, "rb") as f:
            snapshot = pickle.load(f)
        engine.execute("job", Restore(open=opening, snapshot=snapshot, replay=[]), wide)
        step(batches[1], wide)
        engine.execute("job", Close(), wide)
        engine.close()
        return {}
    engine.execute("job", opening)
    first = step(batches[0], None)
    if role == "home":
        with open(snapshot_path + ".tmp", "wb") as f:
            pickle.dump(first.snapshot, f)
        os.rename(snapshot_path + ".tmp", snapshot_path)
    step(batches[1], wide)
    step(batches[2], None)
    job = engine._jobs["job"]
    out = {"step": job.step, "weights": {k: t.cpu().numpy() for k, t in job._trained().items()}}
    engine.close()
    return out
