"""The trainer's control routes (/v1/work, /v1/results, /v1/commit) over real HTTP, with answers
lost on the way back: a retried POST must act once."""

import asyncio

import pytest
from aiohttp import web

from netfaults import FaultyProxy, Faults
from sparrowrl.job import parse
from sparrowrl.trainer import Run
from sparrowrl.transport.client import Client

SPEC = {"apiVersion": "sparrowrl.dev/v1alpha1", "kind": "SparrowRLJob", "metadata": {"name": "control"},
        "spec": {"steps": 2, "model": {"tiny": {"hidden": 32, "layers": 1, "heads": 2}}, "task": {"builtin": "add"},
                 "grpo": {"groupSize": 2, "promptsPerStep": 2, "maxNewTokens": 2},
                 "rollout": {"groupsPerLease": 1}, "topology": {"regions": [{"name": "a", "workers": 1}]}}}


@pytest.fixture
def trainer(tmp_path):
    return Run(parse(SPEC).spec, tmp_path, token="")


async def serve(run: Run) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(run.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def lossy(port: int) -> FaultyProxy:
    """The first answer is cut after its first byte, after the trainer has acted on the request."""
    return FaultyProxy(port, Faults(cut_after=1, cuts=1))


def test_a_commit_whose_answer_was_lost_counts_once(trainer):
    async def go():
        runner, port = await serve(trainer)
        try:
            async with lossy(port) as proxy, Client(proxy.url, attempts=3, backoff=0.01) as c:
                h0 = trainer.coord.hashes[0]
                assert await c.post_json("/v1/commit", {"worker": "w", "version": 0, "state_hash": h0}) == {"verified": True}
                assert proxy.connections == 2  # the answer was lost once and the body sent again
            assert trainer.coord.counts.verified == 1
            async with Client(f"http://127.0.0.1:{port}") as c:  # a new request (new key) acts again
                await c.post_json("/v1/commit", {"worker": "w", "version": 0, "state_hash": h0})
            assert trainer.coord.counts.verified == 2
        finally:
            await runner.cleanup()

    asyncio.run(go())


def test_a_lease_whose_answer_was_lost_is_not_handed_out_twice(trainer):
    async def go():
        runner, port = await serve(trainer)
        try:
            async with lossy(port) as proxy, Client(proxy.url, attempts=3, backoff=0.01) as c:
                ans = await c.post_json("/v1/work", {"worker": "w", "version": 0})
                assert proxy.connections == 2
            assert list(trainer.coord.leases) == [ans["lease"]["id"]]
            lease = ans["lease"]
            results = {str(p["group"]): {"samples": [{"tokens": [3], "logprobs": [-1.0]}] * 2} for p in lease["prompts"]}
            body = {"lease": lease["id"], "worker": "w", "version": 0, "state_hash": trainer.coord.hashes[0],
                    "results": results, "generate_s": 0.1}
            async with lossy(port) as proxy, Client(proxy.url, attempts=3, backoff=0.01) as c:
                assert (await c.post_json("/v1/results", body))["admitted"] == 1
                assert proxy.connections == 2
            assert (trainer.coord.counts.admitted, trainer.coord.counts.duplicated) == (1, 0)
        finally:
            await runner.cleanup()

    asyncio.run(go())
