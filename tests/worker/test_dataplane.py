"""The data plane between workers (worker/dataplane.py): published weights fetched directly, only
with their token, only while kept; encrypted with keys; a fetch from a worker that is gone fails in
time, with a message that says so."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from plexrl.errors import CallFailedError, InvalidRequestError
from plexrl.protocol import auth
from plexrl.protocol.calls import WeightSource
from plexrl.worker.dataplane import KEPT_VERSIONS, DataPlane, host_toward

WEIGHTS = {"layer.weight": np.arange(6 * 512, dtype=np.float32).reshape(6, 512), "bias": np.ones(3, np.float32)}


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.term()


@pytest.fixture
def keys(tmp_path: Path) -> tuple[auth.Credentials, auth.Credentials]:
    """Two workers' credentials from one key directory."""
    pair = auth.init_dir(tmp_path / "keys")
    home = auth.write_pair(tmp_path / "home.key_secret", tmp_path / "home.key")
    sampler = auth.write_pair(tmp_path / "sampler.key_secret", tmp_path / "sampler.key")
    return auth.Credentials(home, pair.public), auth.Credentials(sampler, pair.public)


def planes(
    ctx: zmq.Context[zmq.Socket[bytes]], *credentials: auth.Credentials | None, host: str = "127.0.0.1"
) -> list[DataPlane]:
    return [DataPlane(ctx, host, c) for c in credentials]


def test_published_weights_are_fetched_whole(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    home, sampler = planes(ctx, None, None)
    try:
        source = home.publish("job-1", 3, WEIGHTS)
        assert source.address == home.address and source.key == b"" and source.weight_version == 3
        assert source.local == home.local_address and source.local.startswith("ipc://")
        assert source.nbytes == sum(t.nbytes for t in WEIGHTS.values())
        got = sampler.fetch(source)
        assert got.keys() == WEIGHTS.keys()
        for name, tensor in WEIGHTS.items():
            np.testing.assert_array_equal(got[name], tensor)
            assert got[name].flags.writeable  # the engine keeps them
    finally:
        home.close()
        sampler.close()


def test_with_keys_another_host_fetches_encrypted_and_a_keyless_one_is_refused(
    ctx: zmq.Context[zmq.Socket[bytes]], keys: tuple[auth.Credentials, auth.Credentials]
) -> None:
    """127.0.0.2 is another host here (another data address): it fetches over TCP with CurveZMQ."""
    home, sampler, keyless = [*planes(ctx, keys[0]), *planes(ctx, keys[1], None, host="127.0.0.2")]
    try:
        source = home.publish("job-1", 1, WEIGHTS)
        assert source.key == keys[0].pair.public
        np.testing.assert_array_equal(sampler.fetch(source)["layer.weight"], WEIGHTS["layer.weight"])
        with pytest.raises(CallFailedError, match="--key"):
            keyless.fetch(source)
        # The same source without its Unix socket: the same-host fetcher goes over TCP, encrypted, too.
        (neighbour,) = planes(ctx, keys[1])
        try:
            over_tcp = WeightSource(**{**_fields(source), "local": ""})
            np.testing.assert_array_equal(neighbour.fetch(over_tcp)["bias"], WEIGHTS["bias"])
        finally:
            neighbour.close()
    finally:
        for plane in (home, sampler, keyless):
            plane.close()


def test_a_worker_on_the_same_host_fetches_over_its_unix_socket(
    ctx: zmq.Context[zmq.Socket[bytes]], keys: tuple[auth.Credentials, auth.Credentials]
) -> None:
    home, sampler = planes(ctx, keys[0], keys[1])
    try:
        source = home.publish("job-1", 1, WEIGHTS)
        folder = Path(source.local.removeprefix("ipc://")).parent
        assert folder.stat().st_mode & 0o777 == 0o700  # only this user's processes
        np.testing.assert_array_equal(sampler.fetch(source)["layer.weight"], WEIGHTS["layer.weight"])
    finally:
        home.close()
        sampler.close()
    assert not folder.exists()  # removed with the data plane


def test_a_fetch_needs_the_token_and_a_kept_version(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    home, sampler = planes(ctx, None, None)
    try:
        sources = [home.publish("job-1", v, WEIGHTS) for v in range(1, KEPT_VERSIONS + 2)]
        forged = WeightSource(**{**_fields(sources[-1]), "token": os.urandom(16)})
        with pytest.raises(CallFailedError, match="not published"):
            sampler.fetch(forged)
        with pytest.raises(CallFailedError, match=f"serves version {KEPT_VERSIONS + 1}"):
            sampler.fetch(sources[0])  # dropped: only the newest KEPT_VERSIONS stay
        for kept in sources[1:]:
            assert sampler.fetch(kept).keys() == WEIGHTS.keys()
        home.forget("job-1")
        with pytest.raises(CallFailedError, match="not published"):
            sampler.fetch(sources[-1])
    finally:
        home.close()
        sampler.close()


def test_a_fetch_from_a_worker_that_is_gone_fails_within_its_deadline(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    home, sampler = planes(ctx, None, None)
    source = home.publish("job-1", 1, WEIGHTS)
    home.close()  # the home worker died after it published
    try:
        with pytest.raises(CallFailedError, match="alive and reachable"):
            sampler.fetch(source, timeout_s=0.5)
    finally:
        sampler.close()


def test_without_keys_the_data_plane_serves_loopback_only(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with pytest.raises(InvalidRequestError, match="without authentication"):
        DataPlane(ctx, "10.1.2.3", None)
    assert host_toward("tcp://127.0.0.1:7400") == "127.0.0.1"
    assert host_toward("tcp://localhost:7400") == "127.0.0.1"
    assert host_toward("ipc:///tmp/plexrl.sock") == "127.0.0.1"


def _fields(source: WeightSource) -> dict[str, object]:
    return {name: getattr(source, name) for name in source.__struct_fields__}
