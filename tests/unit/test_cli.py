"""The command line's own parsing: sizes for memory budgets, level thresholds, worker roles,
the Tinker gateway's flags."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytest

from plexrl.cli import _increasing, _parser, main, parse_bytes
from plexrl.coordinator.buckets import Mlfq
from plexrl.errors import InvalidRequestError
from plexrl.gateway.tenants import KeyedTenants


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 << 30), ("512MB", 512 * 10**6), ("2e6", 2_000_000), ("1.5 KiB", 1536), ("0", 0), ("7b", 7)],
)
def test_sizes_parse_with_decimal_and_binary_units(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["12 parsecs", "GiB", "-1GB", ""])
def test_a_bad_size_says_how_to_write_one(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="size"):
        parse_bytes(text)


def test_level_thresholds_parse_and_bad_ones_say_how_to_write_them() -> None:
    args = _parser().parse_args(["coordinator", "--insecure", "--level-service", "1,4.5,20", "--level-peers", "off"])
    assert (args.level_service, args.level_peers) == ((1.0, 4.5, 20.0), ())
    args = _parser().parse_args(["coordinator", "--insecure"])
    assert (args.level_peers, args.level_service) == (Mlfq().peer_ratios, ()) and args.level_peers
    for bad in ("4,1", "0,2", "a,b", "2,,3"):
        with pytest.raises(argparse.ArgumentTypeError, match="2,8,32"):
            _increasing(bad)


def test_worker_roles_are_checked_by_the_command_line() -> None:
    args = _parser().parse_args(["worker", "--coordinator", "tcp://h:1", "--role", "rollout", "--bucket", "2"])
    assert (args.role, args.bucket) == ("rollout", 2)
    with pytest.raises(SystemExit):
        _parser().parse_args(["worker", "--coordinator", "tcp://h:1", "--role", "sampler"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["worker", "--coordinator", "tcp://h:1", "--bucket", "-1"])


def test_the_tinker_gateway_needs_one_place_to_serve_and_says_what_its_tenants_need(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for neither_or_both in ([], ["--coordinator", "tcp://h:1", "--local"]):
        with pytest.raises(SystemExit):
            _parser().parse_args(["tinker", *neither_or_both])
    assert main(["tinker", "--local", "--tenants", "t.json"]) == 2
    assert "--local issues a tenant key per API key itself" in capsys.readouterr().err
    env = {k: v for k, v in os.environ.items() if k != "PLEXRL_COORDINATOR_KEY"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "environ", env)
        assert main(["tinker", "--coordinator", "tcp://h:1", "--tenants", "t.json"]) == 2
    assert "--tenants needs the coordinator's public key" in capsys.readouterr().err
    (tmp_path / "t.json").write_text('["tml-alice"]')
    with pytest.raises(InvalidRequestError, match="give a JSON object of API keys to client key files"):
        KeyedTenants.from_file("tcp://h:1", tmp_path / "t.json", b"x" * 40)


@pytest.mark.parametrize(
    ("device", "visible", "expected_visible"),
    [("cuda:3", None, "3"), ("cuda:1", "4,5,6,7", "5"), ("cuda:0", "2", "2"), ("cpu", "1", "1")],
)
def test_a_gpu_worker_sees_only_its_gpu_and_its_engine_gets_it_as_cuda_0(
    monkeypatch: pytest.MonkeyPatch, device: str, visible: str | None, expected_visible: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    monkeypatch.setattr(os, "environ", env)
    started: list[Any] = []
    monkeypatch.setattr("plexrl.worker.server.run_worker", started.append)
    assert main(["worker", "--coordinator", "tcp://h:1", "--device", device, "--sampler", "hf"]) == 0
    (config,) = started
    assert env["CUDA_VISIBLE_DEVICES"] == expected_visible
    assert config.device == ("cpu" if device == "cpu" else "cuda:0")  # what its Engine is built on
    assert config.name == ("" if device == "cpu" else f"{os.uname().nodename}:{device}")


def test_a_gpu_index_beyond_the_visible_ones_is_refused_with_what_is_visible(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "environ", {**os.environ, "CUDA_VISIBLE_DEVICES": "4,5"})
    assert main(["worker", "--coordinator", "tcp://h:1", "--device", "cuda:2", "--sampler", "hf"]) == 2
    assert "sees 2 GPU(s) (CUDA_VISIBLE_DEVICES='4,5'); give an index below 2" in capsys.readouterr().err


def test_deterministic_turns_on_vllms_batch_invariance_for_the_worker_and_its_engines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_BATCH_INVARIANT", "CUBLAS_WORKSPACE_CONFIG")}
    monkeypatch.setattr(os, "environ", env)
    started: list[Any] = []
    monkeypatch.setattr("plexrl.worker.server.run_worker", started.append)
    gpu = ["worker", "--coordinator", "tcp://h:1", "--sampler", "hf", "--device", "cuda:0"]
    main(gpu)
    assert "VLLM_BATCH_INVARIANT" not in env and not started[-1].deterministic
    # On CPU vLLM has no batch-invariant kernels (they are Triton's): the flag leaves its engine be.
    main(["worker", "--coordinator", "tcp://h:1", "--sampler", "hf", "--deterministic"])
    assert "VLLM_BATCH_INVARIANT" not in env and started[-1].deterministic
    main([*gpu, "--deterministic"])
    assert env["VLLM_BATCH_INVARIANT"] == "1" and env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert started[-1].deterministic
