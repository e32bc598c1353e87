"""``bench/gpu_acceptance.py --device cpu --tiny``: the GPU acceptance script's every code path on
CPU (LoRA GRPO jobs, 3 here against the GPU run's 8, and a full fine-tune on one vLLM worker under
plex), so the script a GPU session runs is known to work before a GPU is lent."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from plexrl.worker.sampler import vllm as vllm_sampler

if not vllm_sampler.available():
    if os.environ.get("PLEXRL_REQUIRE_VLLM"):
        raise RuntimeError("PLEXRL_REQUIRE_VLLM is set but vLLM is not installed")
    pytest.skip("vLLM is not installed", allow_module_level=True)

SCRIPT = Path(__file__).parents[2] / "bench" / "gpu_acceptance.py"


@pytest.mark.slow
def test_the_gpu_acceptance_script_passes_its_dry_run_on_cpu() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--lora-jobs", "3"],
        capture_output=True, text=True, timeout=900, check=False,
        env={**os.environ, "PLEXRL_SAMPLER": "vllm"},
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "gpu_acceptance=pass" in out, out[-4000:]
    for figure in ("peak memory: worker", "peak memory: engine", "sync seconds, lora", "sync seconds, full",
                   "generated tokens/s", "trained tokens/s", "swaps"):  # fmt: skip
        assert figure in out, figure
    # The engines slept around every training phase (--engine-sleep always, its default) and woke
    # before every generate, as the coordinator's trace shows.
    sleeps = re.search(r"engine sleep seconds \(mean \[min-max\] of (\d+)\)", out)
    wakes = re.search(r"engine wake seconds \(mean \[min-max\] of (\d+)\)", out)
    assert sleeps and wakes and int(sleeps[1]) > 0 and int(wakes[1]) > 0, out[-4000:]
    assert re.search(r"training calls with the engines awake \(--engine-sleep always\) +0 ", out), out[-4000:]
    assert re.search(r"generates with the engines asleep +0", out), out[-4000:]
