"""The Tinker gateway against the real ``tinker`` SDK (0.38.0): the SDK's calls a training loop
makes, chunked forward_backward applied in order, a retried request run once, errors reaching the
SDK as its own exceptions, a silent session cleaned up. The gateway runs in this test's event
loop on an embedded cluster; the SDK's blocking calls run in threads."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import sys
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
import tinker

import plexrl
from plexrl.gateway import running, service, wire
from plexrl.gateway.service import Gateway
from plexrl.gateway.tenants import KeyedTenants
from plexrl.models import TINY_MODEL
from plexrl.protocol import auth

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.filterwarnings("ignore::ResourceWarning")]
T = TypeVar("T")
MODEL = str(TINY_MODEL)
SEQUENCES = [[1, 5, 6, 7, 8, 9], [1, 9, 10, 11, 12], [1, 3, 3, 3], [1, 4, 5], [1, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(autouse=True)
def _sdk_connections_collected() -> Iterator[None]:
    """The SDK leaves its HTTP connections to the garbage collector after ``close()``: collect them
    after each test, where their ResourceWarnings are expected (not in a later test)."""
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.fixture(scope="module")
def embedded() -> plexrl.LocalCluster:
    return plexrl.local(workers=1)


class Served:
    """The gateway under test, at ``url``."""

    def __init__(self, gateway: Gateway, url: str) -> None:
        self.gateway, self.url = gateway, url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(embedded: plexrl.LocalCluster) -> AsyncIterator[Served]:
    async with embedded as client:
        assert embedded.keys is not None
        gateway = Gateway(KeyedTenants.issued(client.address, embedded.keys))  # as `plexrl tinker --local`
        async with running(gateway, fwdbwd_max_chunk_len=2) as url:  # five datums: three chunks
            yield Served(gateway, url)


def datums(weights_from: int = 1) -> list[tinker.Datum]:
    """Next-token datums of ``SEQUENCES``: the loss on targets from position ``weights_from`` on."""
    out = []
    for seq in SEQUENCES:
        targets = np.array(seq[1:], np.int64)
        weights = (np.arange(len(targets)) >= weights_from).astype(np.float32)
        out.append(tinker.Datum(model_input=tinker.ModelInput.from_ints(seq[:-1]),
                                loss_fn_inputs={"target_tokens": targets, "weights": weights}))  # fmt: skip
    return out


async def in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await asyncio.to_thread(fn, *args, **kwargs)


def logprobs_of(out: Any) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].to_numpy()) for o in out.loss_fn_outputs]


async def test_a_training_loops_calls_train_sample_and_score_through_the_sdk(served: Served) -> None:
    service_client = await in_thread(tinker.ServiceClient, base_url=served.url, api_key="tml-alice")
    training = await in_thread(service_client.create_lora_training_client, base_model=MODEL, rank=4, seed=1)
    info = await in_thread(training.get_info)
    assert info.model_id.endswith(":train:0") and info.model_data.tokenizer_id == MODEL
    before = await in_thread(lambda: training.forward(datums(), "cross_entropy").result())
    lps = logprobs_of(before)
    assert [len(lp) for lp in lps] == [len(s) - 1 for s in SEQUENCES]  # one logprob per target token
    weighted = -sum(float(lp[1:].sum()) for lp in lps)  # weights: 0 on each first target, 1 after
    assert before.metrics["loss:sum"] == pytest.approx(weighted, rel=1e-4)
    fb = await in_thread(lambda: training.forward_backward(datums(), "cross_entropy").result())
    assert fb.metrics["loss:sum"] == pytest.approx(before.metrics["loss:sum"], rel=1e-5)  # forward changed nothing
    await in_thread(lambda: training.optim_step(tinker.AdamParams(learning_rate=2e-2)).result())
    after = await in_thread(lambda: training.forward(datums(), "cross_entropy").result())
    assert after.metrics["loss:sum"] < before.metrics["loss:sum"]  # the step lowered the loss it was taken on
    sampler = await in_thread(lambda: training.save_weights_and_get_sampling_client().result())
    params = tinker.SamplingParams(max_tokens=6, seed=3, temperature=1.0)
    prompt = tinker.ModelInput.from_ints([1, 5, 6])
    sampled = await in_thread(lambda: sampler.sample(prompt, num_samples=3, sampling_params=params).result())
    assert len(sampled.sequences) == 3
    for seq in sampled.sequences:
        assert 1 <= len(seq.tokens) <= 6 and seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
        assert seq.stop_reason in ("stop", "length")
    scored = await in_thread(lambda: sampler.compute_logprobs(prompt).result())
    assert scored[0] is None and len(scored) == 3
    np.testing.assert_allclose(scored[1:], logprobs_of(after)[0][:2], rtol=0, atol=1e-4)  # the trained weights'
    await in_thread(lambda: service_client.close("success").result())
    assert not [m for m in served.gateway.models.values() if m.owner == "tml-alice"]  # finish closed its job


async def test_chunks_sent_out_of_order_are_applied_in_order_before_the_step(served: Served) -> None:
    """Five datums go as three chunks (first chunk last), the step right behind them: the weights
    after it equal those of one model stepped on all five in one piece (here: the same loss)."""
    service_client = await in_thread(tinker.ServiceClient, base_url=served.url, api_key="tml-bob")

    def run() -> float:
        chunked = service_client.create_lora_training_client(base_model=MODEL, rank=4, seed=2)
        fb = chunked.forward_backward(datums(), "cross_entropy")
        step = chunked.optim_step(tinker.AdamParams(learning_rate=2e-2))
        fb.result(), step.result()
        return float(chunked.forward(datums(), "cross_entropy").result().metrics["loss:sum"])

    chunked_loss = await in_thread(run)
    # The same step in one piece, outside the SDK: one plexrl job, one forward_backward of all five.
    model = next(m for m in served.gateway.models.values() if m.owner == "tml-bob")
    whole = await served.gateway._open("tml-bob", "reference", model.job.spec)
    try:
        train = wire.training(_proto(datums()))
        await whole.forward_backward(train.batch, train.loss)
        await whole.optim_step(plexrl.AdamW(lr=2e-2, betas=(0.9, 0.95), eps=1e-12, grad_clip=None), "sum")
        again = await whole.forward(train.batch, train.loss)
    finally:
        await whole.close()
    assert chunked_loss == pytest.approx(_weighted_loss(again, train.batch), rel=1e-5)
    await in_thread(lambda: service_client.close("success").result())


def _weighted_loss(result: Any, batch: plexrl.Batch) -> float:
    assert result.logprobs is not None and batch.token_weights is not None
    return -float((result.logprobs.values * batch.token_weights.values).sum())


def _proto(data: list[tinker.Datum]) -> Any:
    from tinker.proto import request_conv
    from tinker.types.forward_backward_input import ForwardBackwardInput

    request = tinker.types.ForwardBackwardRequest(
        forward_backward_input=ForwardBackwardInput(data=data, loss_fn="cross_entropy"), model_id="m", seq_id=1
    )
    return request_conv.forward_backward_request_to_proto(request)


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str = "tml-carol") -> Any:
    async with session.post(url, json=body, headers={"X-API-Key": key}) as response:
        return response.status, await response.json()


async def test_a_retried_request_runs_once_and_a_silent_session_is_finished(served: Served) -> None:
    api = f"{served.url}/api/v1"
    async with aiohttp.ClientSession() as http:
        _, created = await _post(http, f"{api}/create_session", {"tags": [], "user_metadata": None, "sdk_version": "x"})
        session_id = created["session_id"]
        _, future = await _post(http, f"{api}/create_model", {"session_id": session_id, "model_seq_id": 0,
                                                              "base_model": MODEL, "lora_config": {"rank": 2}})  # fmt: skip
        _, opened = await _post(http, f"{api}/retrieve_future", {"request_id": future["request_id"]})
        model_id = opened["model_id"]
        job = served.gateway.models[model_id].job
        step = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
        first = await _post(http, f"{api}/optim_step", step)
        again = await _post(http, f"{api}/optim_step", step)  # the SDK's retry: same seq_id
        assert first == again and first[0] == 200
        _, outcome = await _post(http, f"{api}/retrieve_future", {"request_id": first[1]["request_id"]})
        assert "no accumulated gradients" in outcome["error"]  # it ran (on no gradients: it says so)
        info = next(j for j in (await job.client.status()).jobs if j.job_id == job.job_id)
        assert info.calls_done == 2  # its open and one optim_step
        # Another key sees none of it.
        status, body = await _post(http, f"{api}/get_info", {"model_id": model_id}, key="tml-mallory")
        assert status == 404 and "error" in body
        status, body = await _post(http, f"{api}/create_session", {}, key="not-a-key")
        assert status == 401
        # The session's heartbeats stop: it is finished, its job closed, its next heartbeat refused.
        served.gateway.sessions[session_id].heard_at -= service.SESSION_TIMEOUT_S + 1
        assert any(k[1].startswith(session_id) for k in served.gateway._by_seq)
        await served.gateway.expire()
        assert not any(k[1].startswith(session_id) for k in served.gateway._by_seq)  # its retries are over
        assert job.job_id not in {j.job_id for j in (await job.client.status()).jobs}
        status, _ = await _post(http, f"{api}/session_heartbeat", {"session_id": session_id})
        assert status == 410


async def test_errors_reach_the_sdk_as_its_own_exceptions(served: Served) -> None:
    service_client = await in_thread(tinker.ServiceClient, base_url=served.url, api_key="tml-dave")
    training = await in_thread(service_client.create_lora_training_client, base_model=MODEL, rank=2)
    with pytest.raises(tinker.RequestFailedError, match="loss_fn 'dro'") as unsupported:
        await in_thread(lambda: training.forward_backward(datums(), "dro").result())
    assert unsupported.value.category == tinker.types.RequestErrorCategory.User
    shifted_wrong = tinker.Datum(model_input=tinker.ModelInput.from_ints([1, 2, 3]),
                                 loss_fn_inputs={"target_tokens": np.array([7, 7, 7], np.int64)})  # fmt: skip
    with pytest.raises(tinker.RequestFailedError, match="shifted by one"):
        await in_thread(lambda: training.forward_backward([shifted_wrong], "cross_entropy").result())
    # The requests after the failed ones still run, in order.
    fb = await in_thread(lambda: training.forward_backward(datums(), "cross_entropy").result())
    assert fb.metrics["loss:sum"] > 0
    await in_thread(lambda: service_client.close("success").result())


async def test_the_plexrl_tinker_command_serves_an_unmodified_sdk_program(
    embedded: plexrl.LocalCluster, served: Served
) -> None:
    """``plexrl tinker`` as its own process, with a client key of the running cluster."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **embedded.client_env()}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "plexrl", "tinker", "--coordinator", embedded.address, "--bind", f"127.0.0.1:{port}",
        env=env, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stderr is not None
    try:
        async with asyncio.timeout(60):
            while b"Tinker gateway on" not in (line := await process.stderr.readline()):
                assert line, "the gateway exited before it served"
        url = f"http://127.0.0.1:{port}"

        def program() -> tuple[int, str]:
            service_client = tinker.ServiceClient(base_url=url, api_key="tml-erin")
            training = service_client.create_lora_training_client(base_model=MODEL, rank=2)
            info = training.get_info()
            out = training.forward_backward(datums(), "cross_entropy").result()
            service_client.close("success").result()
            return len(out.loss_fn_outputs), info.model_id

        outputs, model_id = await in_thread(program)
        assert outputs == len(SEQUENCES) and ":train:" in model_id
    finally:
        process.terminate()
        assert await process.wait() == 0  # SIGTERM: a clean exit


async def test_each_api_key_is_its_own_plexrl_tenant_and_a_tenants_map_refuses_other_keys(
    embedded: plexrl.LocalCluster, served: Served, tmp_path: Any
) -> None:
    def program(url: str, api_key: str) -> tuple[tinker.ServiceClient, str]:
        service_client = tinker.ServiceClient(base_url=url, api_key=api_key)
        training = service_client.create_lora_training_client(base_model=MODEL, rank=2).result()
        return service_client, training.get_info().model_id

    (frank, frank_model), (gina, gina_model) = [
        await in_thread(program, served.url, k) for k in ("tml-frank", "tml-gina")
    ]
    assert embedded.client is not None
    owners = {m.owner: m.job.job_id for m in served.gateway.models.values() if m.model_id in (frank_model, gina_model)}
    status = await embedded.client.status()
    tenants = {j.job_id: j.owner for j in status.jobs}
    assert set(owners) == {"tml-frank", "tml-gina"}
    frank_tenant, gina_tenant = tenants[owners["tml-frank"]], tenants[owners["tml-gina"]]
    assert frank_tenant != gina_tenant and frank_tenant.startswith("tinker-") and gina_tenant.startswith("tinker-")
    assert "tml-" not in frank_tenant + gina_tenant  # an API key is a secret: no tenant is named by it
    for service_client in (frank, gina):
        await in_thread(lambda c=service_client: c.close("success").result())  # type: ignore[misc]

    # A --tenants map: its keys' jobs are on the key files it names; any other API key is refused.
    assert embedded.keys is not None
    auth.add_key(embedded.keys, "henry", "client")
    (tmp_path / "tenants.json").write_text('{"tml-henry": "%s"}' % (embedded.keys / "secret" / "henry.key_secret"))
    public = auth.load_public(embedded.keys / "coordinator.key")
    mapped = Gateway(KeyedTenants.from_file(embedded.address, tmp_path / "tenants.json", public))
    async with running(mapped) as url:
        henry, henry_model = await in_thread(program, url, "tml-henry")
        job = next(m.job.job_id for m in mapped.models.values() if m.model_id == henry_model)
        assert {j.job_id: j.owner for j in (await embedded.client.status()).jobs}[job] == "henry"
        await in_thread(lambda: henry.close("success").result())
        with pytest.raises(tinker.AuthenticationError, match="not one of the gateway's tenants"):
            await in_thread(program, url, "tml-ivan")
