"""The trainer's control routes (/v1/work, /v1/results, /v1/commit) over real HTTP, with answers
lost on the way back: a retried POST must act once."""

import asyncio

import pytest
from aiohttp import web
from support import jobs
from support.netfaults import Faults, FaultyProxy
from support.servers import listen
from support.wait import until_async

from sparrowrl.spec.job import parse
from sparrowrl.trainer.trainer import Trainer
from sparrowrl.transport.client import Client

SPEC = jobs.job(
    "control",
    steps=2,
    grpo={"groupSize": 2, "promptsPerStep": 2, "maxNewTokens": 2},
    rollout={"groupsPerLease": 1},
    topology={"regions": [{"name": "a", "workers": 1}]},
)


@pytest.fixture
def trainer(tmp_path):
    return Trainer(parse(SPEC).spec, tmp_path, token="")


async def serve(run: Trainer) -> tuple[web.AppRunner, int]:
    runner, url = await listen(run.app())
    return runner, int(url.rsplit(":", 1)[1])


def lossy(port: int) -> FaultyProxy:
    """The first answer is cut after its first byte, after the trainer has acted on the request."""
    return FaultyProxy(port, Faults(cut_after=1, cuts=1))


def test_a_commit_whose_answer_was_lost_counts_once(trainer):
    async def go():
        runner, port = await serve(trainer)
        try:
            async with lossy(port) as proxy, Client(proxy.url, attempts=3, backoff=0.01) as c:
                h0 = trainer.coord.hash_of(0)
                assert await c.post_json("/v1/commit", {"worker": "w", "version": 0, "state_hash": h0}) == {
                    "verified": True
                }
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
            assert [x.id for x in trainer.coord.leases()] == [ans["lease"]["id"]]
            lease = ans["lease"]
            results = {
                str(p["group"]): {"samples": [{"tokens": [3], "logprobs": [-1.0]}] * 2} for p in lease["prompts"]
            }
            body = {
                "lease": lease["id"],
                "worker": "w",
                "version": 0,
                "state_hash": trainer.coord.hash_of(0),
                "results": results,
                "generate_s": 0.1,
            }
            async with lossy(port) as proxy, Client(proxy.url, attempts=3, backoff=0.01) as c:
                assert (await c.post_json("/v1/results", body))["admitted"] == 1
                assert proxy.connections == 2
            assert (trainer.coord.counts.admitted, trainer.coord.counts.discarded_late) == (1, 0)
        finally:
            await runner.cleanup()

    asyncio.run(go())


def post(port: int, path: str, data: bytes) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def valid(trainer, path: str) -> dict:
    h0 = trainer.coord.hash_of(0)
    return {
        "/v1/work": {"worker": "w", "version": 0},
        "/v1/commit": {"worker": "w", "version": 0, "state_hash": h0, "fetch_s": 0.1},
        "/v1/results": {
            "lease": 0,
            "worker": "w",
            "version": 0,
            "state_hash": h0,
            "generate_s": 0.1,
            "results": {"0": {"samples": [{"tokens": [3], "logprobs": [-1.0]}] * 2}},
        },
    }[path]


@pytest.mark.usefixtures("address_space_limit")
@pytest.mark.parametrize(
    "path, edit, field",
    [
        ("/v1/results", lambda b: b.update(lease=-1), "lease: Input should be greater than or equal to 0"),
        ("/v1/results", lambda b: b.pop("worker"), "worker: Field required"),
        ("/v1/commit", lambda b: b.update(fetch_s=float("inf")), "fetch_s: Input should be a finite number"),
        ("/v1/commit", lambda b: b.update(version=10**30), "version: Input should be less than 100000000"),
        ("/v1/work", lambda b: b.update(worker="../x" * 100), "worker: String should match pattern"),
        ("/v1/work", lambda b: b.pop("worker"), "worker: Field required"),
    ],
)
def test_a_malformed_body_is_refused_with_its_field_before_anything_acts(trainer, path, edit, field):
    import json

    body = valid(trainer, path)
    edit(body)

    async def go():
        runner, port = await serve(trainer)
        try:
            status, text = await asyncio.to_thread(post, port, path, json.dumps(body).encode())
            assert status == 400 and text.startswith(f"{path}: {field}"), text
            for junk, reason in ((b"{not json", "Expecting property name"), (b"[" * 100_000, "nested too deeply")):
                status, text = await asyncio.to_thread(post, port, path, junk)
                assert status == 400 and text.startswith(f"{path}: ") and reason in text, text
        finally:
            await runner.cleanup()

    asyncio.run(go())
    c = trainer.coord.counts
    assert (c.admitted, c.verified, [x.id for x in trainer.coord.leases()], trainer.coord.fleet.heard_from) == (
        0,
        0,
        [],
        0,
    )


@pytest.mark.usefixtures("address_space_limit")
@pytest.mark.parametrize(
    "edit, field",
    [
        (
            lambda s: s.update(logprobs=[float("nan")]),
            "results.0.samples.0.logprobs.0: Input should be a finite number",
        ),
        (
            lambda s: s.update(logprobs=[1e300]),
            "results.0.samples.0.logprobs.0: Input should be less than or equal to 0",
        ),
        (lambda s: s.update(tokens=[3.5]), "results.0.samples.0.tokens.0: Input should be a valid integer"),
    ],
)
def test_malformed_results_refuse_their_lease_and_its_groups_go_back(trainer, edit, field):
    """Workers are not trusted: one NaN log-prob admitted would make every weight NaN. The
    worker goes on; its lease's groups are handed out again."""
    import json

    async def go():
        runner, port = await serve(trainer)
        try:
            async with Client(f"http://127.0.0.1:{port}") as c:
                lease = (await c.post_json("/v1/work", {"worker": "w", "version": 0}))["lease"]
            body = valid(trainer, "/v1/results")
            body["lease"] = lease["id"]
            body["results"] = {
                str(p["group"]): {"samples": [{"tokens": [3], "logprobs": [-1.0]} for _ in range(2)]}
                for p in lease["prompts"]
            }
            edit(next(iter(body["results"].values()))["samples"][0])
            body_json = json.dumps(body).encode()
            status, text = await asyncio.to_thread(post, port, "/v1/results", body_json)
            assert status == 200 and json.loads(text) == {"admitted": 0, "refused": f"/v1/results: {field}"}, text
            assert lease["id"] not in [x.id for x in trainer.coord.leases()]
            async with Client(f"http://127.0.0.1:{port}") as c:  # the same groups, to whoever asks next
                again = (await c.post_json("/v1/work", {"worker": "w", "version": 0}))["lease"]
            assert again["groups"] == lease["groups"] and again["id"] != lease["id"]
        finally:
            await runner.cleanup()

    asyncio.run(go())
    assert trainer.coord.counts.admitted == 0


def test_a_body_past_what_a_lease_can_carry_is_413(trainer):
    """The body limit follows the job: a lease's results with every token fit, more does not."""
    from sparrowrl.spec import messages

    limit = messages.max_body(trainer.spec.lease_tokens)

    async def go():
        runner, port = await serve(trainer)
        try:
            status, text = await asyncio.to_thread(post, port, "/v1/results", b" " * (limit + 1))
            assert status == 413 and str(limit) in text, text
        finally:
            await runner.cleanup()

    asyncio.run(go())


def test_worker_names_are_bounded(trainer, monkeypatch):
    """Each name a worker gives is remembered (status, idempotency): a bounded number of them."""
    import json

    from sparrowrl.trainer import control

    monkeypatch.setattr(control, "MAX_WORKERS", 2)

    async def go():
        runner, port = await serve(trainer)
        try:
            h0 = trainer.coord.hash_of(0)
            for name, want in (("a", 200), ("b", 200), ("a", 200), ("c", 503)):
                body = {"worker": name, "version": 0, "state_hash": h0}
                status, text = await asyncio.to_thread(post, port, "/v1/commit", json.dumps(body).encode())
                assert status == want, (name, status, text)
            assert "tracks 2 workers already; 'c'" in text
        finally:
            await runner.cleanup()

    asyncio.run(go())
    assert trainer.coord.fleet.live() == ["a", "b"]


@pytest.mark.timeout(120)
def test_the_trainer_serves_with_its_long_lived_heap_out_of_the_collectors_passes(tmp_path):
    """A full collection walks every object the collector tracks, on the event loop's thread. A
    trainer's imports and model are hundreds of thousands of objects (a 200-300 ms stall of every
    request, every few seconds, at a thousand workers: hack/bench_scale.py). Once it serves, they
    are frozen: a full pass walks what came after, a small fraction of them."""
    import gc

    from support.servers import free_port, get

    from sparrowrl.trainer import trainer as trainer_process

    url = f"http://127.0.0.1:{(port := free_port())}/readyz"

    async def go():
        job = asyncio.create_task(trainer_process.serve(parse(SPEC).spec, tmp_path, "127.0.0.1", port, token=""))

        async def ready() -> bool:
            assert not job.done(), job.exception()
            return await asyncio.to_thread(get, url) == 200

        try:
            await until_async(ready, 60, "the trainer serving", every=0.05)
            frozen, walked = gc.get_freeze_count(), len(gc.get_objects())
            assert frozen > 100_000 and walked * 10 < frozen, (frozen, walked)
        finally:
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)
            gc.unfreeze()

    gc.unfreeze()  # whatever another test left frozen
    asyncio.run(go())
