"""Which accelerator a worker process uses: the one its ``--device`` names, made the only one the
process sees.

vLLM's engine takes the first GPU its process sees (its single-GPU executor runs on local rank
0), so a worker started with ``--device cuda:3`` that only passed ``cuda`` on would put its engine
on GPU 0 beside every other worker's. The worker instead narrows ``CUDA_VISIBLE_DEVICES`` to its
GPU before CUDA starts: its trainer, its mover and its engines (and any engine-core process they
spawn, which inherits the variable) all use that GPU, which they call ``cuda:0``.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping


def isolate(device: str, environ: MutableMapping[str, str] | None = None) -> str:
    """Make ``device`` (``cpu`` or ``cuda:N``) the only GPU this process and its children see and
    return its name inside the process (``cuda:0``; ``cpu`` unchanged). ``N`` counts among the
    GPUs visible before (a scheduler such as Ray may have narrowed them already). Call it before
    anything starts CUDA."""
    if not device.startswith("cuda"):
        return device
    environ = os.environ if environ is None else environ
    index = int(device.partition(":")[2] or 0)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        environ["CUDA_VISIBLE_DEVICES"] = str(index)
        return "cuda:0"
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if index >= len(ids):
        raise ValueError(
            f"--device {device}: this process sees {len(ids)} GPU(s) (CUDA_VISIBLE_DEVICES={visible!r}); "
            f"give an index below {len(ids)}"
        )
    environ["CUDA_VISIBLE_DEVICES"] = ids[index]
    return "cuda:0"
