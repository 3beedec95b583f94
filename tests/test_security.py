"""Relays that need no trust, and credentials per role. A relay that forges (altered bytes, an
altered list, an old version under a new number, another job's version, a delta recomputed to a
matching additive hash, a plan that stops short, an altered base or its bytes) is caught by the
worker before any weight changes; it falls back to the origin and reports the relay. Each role's
token does what that role may, and nothing else. All over real HTTP on loopback."""

import asyncio
import hashlib
import json

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from support.jobs import job
from support.servers import TOKEN, Server, listen, serving
from support.tensors import mutated, same

from sparrowrl.auth.signing import (
    Signer,
    base_statement,
    parse_public,
    piece_statement,
    public_text,
    table_statement,
    trust,
)
from sparrowrl.auth.tokens import Gate, Principal, acts_as, allowed, mint
from sparrowrl.delta import state_hash
from sparrowrl.spec.job import parse
from sparrowrl.store.store import Store
from sparrowrl.trainer.trainer import Trainer
from sparrowrl.transport.client import Client
from sparrowrl.transport.failover import FetchError

OTHER = "another-job's-secret"
SIGNER = Signer(TOKEN)
WORKER = mint(SIGNER, "worker", "w1")
RELAY = mint(SIGNER, "relay", "eu")


class Forger:
    """A relay gone bad: it answers as its upstream does, except where `forge(request, get)`
    answers otherwise; `get(url, path_qs, headers)` is (status, headers, body) from upstream."""

    def __init__(self, origin: str, forge):
        self.origin, self.forge = origin, forge

    async def __aenter__(self):
        self.session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {RELAY}"})

        async def get(url: str, path_qs: str, headers: dict | None = None):
            async with self.session.get(url + path_qs, headers=headers or {}) as r:
                return (
                    r.status,
                    {k: v for k, v in r.headers.items() if k in ("Content-Range", "Content-Type")},
                    await r.read(),
                )

        async def answer(request: web.Request) -> web.Response:
            range_ = {"Range": request.headers["Range"]} if "Range" in request.headers else {}
            made = await self.forge(request, get)
            status, headers, body = made or await get(self.origin, request.path_qs, range_)
            return web.Response(status=status, headers=headers, body=body)

        app = web.Application()
        app.router.add_get("/{path:.*}", answer)
        self.runner, self.url = await listen(app)
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()
        await self.session.close()


def flip(body: bytes, at: int) -> bytes:
    b = bytearray(body)
    b[at] ^= 0x40
    return bytes(b)


def from_other(url: str, token: str):
    """The version listing and everything about v5 (its pieces and bytes) from another server."""

    async def forge(request, get):
        if request.path == "/v1/versions" or request.path.startswith("/v1/versions/5/"):
            headers = {"Range": request.headers["Range"]} if "Range" in request.headers else {}
            return await get(url, request.path_qs, {**headers, "Authorization": f"Bearer {token}"})
        return None

    return forge


def flipped(path: str):
    """The listing is the trainer's; the bytes of `path` are not."""

    async def forge(request, get):
        if request.path == path:
            status, headers, body = await get(FORGED["origin"], request.path_qs, {"Range": request.headers["Range"]})
            return status, headers, flip(body, len(body) // 2)
        return None

    return forge


async def edited(request, get, edit) -> tuple:
    """The origin's JSON answer to this request, as `edit(doc)` changes it."""
    status, headers, body = await get(FORGED["origin"], request.path_qs)
    doc = json.loads(body)
    edit(doc)
    return status, headers, json.dumps(doc).encode()


async def altered_list(request, get, table=True):
    """Bytes altered, and the list's digest of that piece changed to match them (`table`: the
    whole table's signature kept, else dropped, so that each piece's is what is checked)."""
    if request.path == "/v1/versions/5/pieces":
        status, headers, body = await get(FORGED["origin"], "/v1/versions/5/pieces?after=0")
        doc = json.loads(body)
        if not table:
            del doc["table_sig"]
        o, n = doc["pieces"][1][:2]
        _, _, data = await get(FORGED["origin"], "/v1/versions/5/delta", {"Range": f"bytes={o}-{o + n - 1}"})
        doc["pieces"][1][2] = hashlib.sha256(flip(data, n // 2)).hexdigest()
        return status, headers, json.dumps(doc).encode()
    if request.path == "/v1/versions/5/delta":
        status, headers, body = await get(FORGED["origin"], request.path_qs, {"Range": request.headers["Range"]})
        o, n = FORGED["piece1"]
        start = int(request.headers["Range"].split("=")[1].split("-")[0])
        if start <= o + n // 2 < start + len(body):
            body = flip(body, o + n // 2 - start)
        return status, headers, body
    return None


async def replayed(request, get):
    """v4's delta, served as v5."""
    if request.path.startswith("/v1/versions/5/"):
        headers = {"Range": request.headers["Range"]} if "Range" in request.headers else {}
        return await get(FORGED["origin"], request.path_qs.replace("/5/", "/4/"), headers)
    return None


async def short_plan(request, get):
    """A plan that stops at v4 (the base) for a worker that asks for v5, and the listing's v5
    state hash made v4's: the worker would hold v4 and call it v5."""
    if request.path == "/v1/plan":
        return (
            200,
            {"Content-Type": "application/json"},
            json.dumps({"route": "base", "base": 4, "deltas": [], "bytes": 0}).encode(),
        )

    def as_v4(doc: dict) -> None:
        by = {e["version"]: e for e in doc["versions"]}
        by[5]["state_hash"] = by[4]["state_hash"]

    return await edited(request, get, as_v4) if request.path == "/v1/versions" else None


async def altered_base(request, get):
    """A listing whose base snapshot of v4 names other parts."""

    def other_parts(doc: dict) -> None:
        for e in doc["versions"]:
            if e["base"]:
                e["base"]["parts"][0] = "0" * 64

    return await edited(request, get, other_parts) if request.path == "/v1/versions" else None


FORGED: dict = {}  # the honest origin's URL and the second piece of v5, for the forgers above


@pytest.fixture(scope="module")
def jobs(history, tmp_path_factory):
    """Another job's store that shares our v4 (the same weights, so the same state hash), and a
    forger's store whose v5 is a self-consistent delta to weights of its choosing: its manifest's
    additive hash is recomputed to match them."""
    path, states = history
    other = Store.init(tmp_path_factory.mktemp("other") / "s", states[4], base_every=4, version=4)
    other.add(mutated(np.random.default_rng(9), states[4], 0.02))
    forged_state = {k: v.clone() for k, v in states[5].items()}
    forged_state["w"].view(-1)[:100] = 0.5  # the weights the forger wants every worker of its region to run
    forged = Store.init(tmp_path_factory.mktemp("forged") / "s", states[4], base_every=4, version=4)
    forged.add(forged_state)
    return path, states, other.path, forged.path, forged_state


def have(states, v):
    state = {k: t.clone() for k, t in states[v].items()}
    return v, state, state_hash(state)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "case",
    [
        "altered bytes",
        "altered list",
        "altered list, per piece",
        "replayed version",
        "another job's version",
        "recomputed additive hash",
        "a plan that stops short",
        "altered base",
        "altered base bytes",
    ],
)
def test_a_forging_relay_is_caught_before_any_weight_changes(jobs, case):
    path, states, other, forged, forged_state = jobs
    key = Signer(TOKEN).verifier

    async def go():
        async with (
            Server(path) as origin,
            Server(other, token=OTHER) as other_job,
            Server(forged, token="", port=0) as forger_origin,
        ):
            FORGED["origin"] = origin.url
            async with Client(origin.url, token=WORKER, trust=key) as c:
                FORGED["piece1"] = tuple((await c.json("/v1/versions/5/pieces"))["pieces"][1][:2])
            forge = {
                "altered bytes": flipped("/v1/versions/5/delta"),
                "altered list": altered_list,
                "altered list, per piece": lambda r, g: altered_list(r, g, table=False),
                "replayed version": replayed,
                "another job's version": from_other(other_job.url, OTHER),
                "recomputed additive hash": from_other(forger_origin.url, ""),
                "a plan that stops short": short_plan,
                "altered base": altered_base,
                "altered base bytes": flipped("/v1/versions/4/base"),
            }[case]
            async with Forger(origin.url, forge) as relay:
                target = 4 if case.startswith("altered base") else 5
                start = None if case.startswith("altered base") else have(states, 4)
                # the relay alone: refused, and the weights held are untouched
                async with Client([relay.url], token=WORKER, trust=key, attempts=2, backoff=0.01) as c:
                    with pytest.raises(FetchError):
                        await c.advance(target, start)
                    if start is not None:
                        assert same(start[1], states[4])
                # with the origin behind it: the worker falls back, gets the trainer's weights, reports the relay
                async with Client([relay.url, origin.url], token=WORKER, trust=key, backoff=0.01) as c:
                    state, h = await c.advance(target, have(states, 4) if start else None)
                    assert same(state, states[target]) and h == state_hash(states[target])
                    assert c.stats.refused[relay.url] >= 1 and origin.url not in c.stats.refused
                if case in ("another job's version", "recomputed additive hash"):
                    # without the trainer's key, the same relay would have its way: the test can fail
                    async with Client([relay.url], token=WORKER, trust=None) as c:
                        state, _ = await c.advance(5, have(states, 4))
                        assert not same(state, states[5])
                        if case == "recomputed additive hash":
                            assert same(state, forged_state)

    asyncio.run(go())


def test_signatures_bind_version_key_and_every_field():
    s, other = Signer(TOKEN), Signer(OTHER)
    h = "ab" * 32
    sig = s.sign(piece_statement(5, 0, 100, h, False))
    assert s.verifier.ok(piece_statement(5, 0, 100, h, False), sig)
    for changed in [
        piece_statement(6, 0, 100, h, False),
        piece_statement(5, 1, 100, h, False),
        piece_statement(5, 0, 101, h, False),
        piece_statement(5, 0, 100, "cd" * 32, False),
        piece_statement(5, 0, 100, h, True),
    ]:
        assert not s.verifier.ok(changed, sig)
    assert not other.verifier.ok(piece_statement(5, 0, 100, h, False), sig)
    base = base_statement(4, "0" * 16, 10, 1 << 16, [h])
    assert not s.verifier.ok(base, sig) and s.verifier.ok(base, s.sign(base))  # a piece's is not a base's
    assert not s.verifier.ok(piece_statement(5, 0, 100, h, False), "A" * 86)
    table = [[0, 100, h, False, ""], [100, 50, h, True, ""]]
    tsig = s.sign(table_statement(5, table))
    assert s.verifier.ok(table_statement(5, table), tsig) and not s.verifier.ok(table_statement(6, table), tsig)
    for i, j, x in [(0, 1, 101), (1, 3, False), (1, 2, "cd" * 32)]:
        changed = [list(p) for p in table]
        changed[i][j] = x
        assert not s.verifier.ok(table_statement(5, changed), tsig)
    assert not s.verifier.ok(table_statement(5, table[:1]), tsig)  # a piece dropped
    assert parse_public(public_text(s.key)).public_bytes_raw() == s.key.public_key().public_bytes_raw()
    with pytest.raises(ValueError, match="SPARROWRL_TRAINER_KEY"):
        trust(WORKER, "")  # a role token alone could check nothing
    with pytest.raises(ValueError, match="not 32 bytes"):
        parse_public("ed25519:AAAA")


def test_what_each_role_may_do():
    gate = Gate.of(TOKEN, None)
    worker, relay, admin = (gate.principal(f"Bearer {t}") for t in (WORKER, RELAY, mint(SIGNER, "admin", "")))
    assert worker == Principal("worker", "w1") and relay == Principal("relay", "eu") and admin.role == "admin"
    assert gate.principal(f"Bearer {TOKEN}").role == "admin"
    assert gate.principal(f"Bearer {mint(Signer(OTHER), 'admin', '')}") is None  # another job's key
    assert gate.principal(f"Bearer {WORKER[:-2]}AA") is None and gate.principal("Bearer sprl1.x.y") is None
    assert gate.principal(WORKER) is None  # not a bearer header
    for who, method, path, ok in [
        (relay, "GET", "/v1/versions", True),
        (relay, "GET", "/v1/versions/5/delta", True),
        (relay, "GET", "/v1/plan", True),
        (relay, "GET", "/v1/job", False),
        (relay, "POST", "/v1/results", False),
        (relay, "GET", "/v1/status", False),
        (relay, "GET", "/metrics", False),
        (worker, "GET", "/v1/versions/5/pieces", True),
        (worker, "GET", "/v1/model/config.json", True),
        (worker, "POST", "/v1/work", True),
        (worker, "GET", "/v1/status", False),
        (worker, "GET", "/metrics", False),
        (worker, "POST", "/v1/versions", False),
        (admin, "GET", "/v1/status", True),
    ]:
        assert (allowed(who, method, path) is None) == ok, (who, method, path)
    slot = Principal("worker", "grpo-worker-eu-1-*")  # a cluster's worker slot: each attempt's pod
    assert acts_as(slot, "grpo-worker-eu-1-0") and acts_as(slot, "grpo-worker-eu-1-12")
    assert not any(
        acts_as(slot, w)
        for w in (
            "grpo-worker-eu-1-",
            "grpo-worker-eu-10",
            "grpo-worker-eu-2-0",
            "grpo-worker-eu-1-0-1",
            "grpo-worker-eu-1-*",
        )
    )
    assert acts_as(worker, "w1") and not acts_as(worker, "w2") and not acts_as(relay, "eu")


SPEC = job(
    "roles",
    steps=2,
    grpo={"groupSize": 2, "promptsPerStep": 2, "maxNewTokens": 2},
    rollout={"groupsPerLease": 1},
    topology={"regions": [{"name": "a", "workers": 1}]},
)


@pytest.mark.timeout(120)
def test_per_role_tokens_over_http(tmp_path):
    """A worker's token leases, submits and commits under its own name only; a relay's reads
    versions and nothing else; neither reads the job's status."""
    run = Trainer(parse(SPEC).spec, tmp_path, token=TOKEN)
    w2 = mint(SIGNER, "worker", "w2")

    async def go():
        runner, url = await listen(run.app())
        try:
            async with aiohttp.ClientSession() as s:

                async def call(token, method, path, body=None):
                    async with s.request(
                        method, url + path, json=body, headers={"Authorization": f"Bearer {token}"}
                    ) as r:
                        return r.status, await r.text()

                h0 = run.coord.hash_of(0)
                lease = json.loads((await call(WORKER, "POST", "/v1/work", {"worker": "w1", "version": 0}))[1])
                lease = lease["lease"]
                status, text = await call(w2, "POST", "/v1/work", {"worker": "w1", "version": 0})
                assert status == 403 and "'w2'" in text and "'w1'" in text
                results = {
                    str(p["group"]): {"samples": [{"tokens": [3], "logprobs": [-1.0]}] * 2} for p in lease["prompts"]
                }
                body = {
                    "lease": lease["id"],
                    "worker": "w1",
                    "version": 0,
                    "state_hash": h0,
                    "results": results,
                    "generate_s": 0.1,
                }
                assert (await call(w2, "POST", "/v1/results", body))[0] == 403  # w1's lease, w2's token
                malformed = {**body, "generate_s": -1.0}  # refuses its lease, but only its worker's token may
                assert (await call(w2, "POST", "/v1/results", malformed))[0] == 403
                assert lease["id"] in [x.id for x in run.coord.leases()]
                assert (await call(RELAY, "POST", "/v1/results", body))[0] == 403
                assert run.coord.counts.admitted == 0
                status, text = await call(w2, "POST", "/v1/commit", {"worker": "w1", "version": 0, "state_hash": h0})
                assert status == 403 and run.coord.counts.verified == 0
                status, text = await call(WORKER, "POST", "/v1/results", body)
                assert status == 200 and json.loads(text)["admitted"] == 1
                for token in (WORKER, RELAY):
                    assert (await call(token, "GET", "/v1/versions"))[0] == 200
                    assert (await call(token, "GET", "/v1/status"))[0] == 403
                    assert (await call(token, "GET", "/metrics"))[0] == 403
                assert (await call(RELAY, "GET", "/v1/job"))[0] == 403
                assert (await call(WORKER, "GET", "/v1/job"))[0] == 200
                assert (await call(mint(Signer(OTHER), "worker", "w1"), "GET", "/v1/versions"))[0] == 401
                # a worker reports what its relay sent that did not verify: the job's status shows it
                body = {"worker": "w1", "version": 0, "state_hash": h0, "refused": 3}
                assert json.loads((await call(WORKER, "POST", "/v1/commit", body))[1]) == {"verified": True}
                status, text = await call(TOKEN, "GET", "/v1/status")
                assert status == 200
                assert [(w["name"], w["refused_answers"]) for w in json.loads(text)["workers"]] == [("w1", 3)]
        finally:
            await runner.cleanup()

    asyncio.run(go())


@pytest.mark.timeout(120)
def test_a_relay_forwards_signatures_it_cannot_make(history, tmp_path, monkeypatch):
    """A relay that holds only its role token and the public key mirrors the versions with the
    trainer's signatures, and lists them as its own store's; its workers check them."""
    from sparrowrl.transport.relay import Relay, make_relay_app

    path, states = history
    key = Signer(TOKEN).verifier
    monkeypatch.setenv("SPARROWRL_TRAINER_KEY", public_text(SIGNER.key))

    async def go():
        async with Server(path) as origin:
            relay = Relay([origin.url], tmp_path / "mirror", token=RELAY, backoff=0.01)
            runner, url = await listen(make_relay_app(relay, RELAY))  # never a signer: it has no key
            try:
                async with Client([url], token=WORKER, trust=key) as c:
                    await c.versions(delta=6, wait=30)
                    state, _ = await c.advance(6, have(states, 4))
                    assert same(state, states[6]) and not c.stats.refused
                    listed = (await c.json("/v1/versions/6/pieces"))["pieces"]
                    assert all(p[4] for p in listed) and listed[-1][3]  # signed, in file order, from its store
                    assert (await c.json("/v1/versions/6/pieces"))["table_sig"]  # and the table at once
                    assert (await c.json("/v1/versions"))["versions"][0]["base"]["sig"]  # a base's too
            finally:
                await runner.cleanup()
        kept = Store(tmp_path / "mirror").versions[6]
        assert len(kept.delta_sigs) == len(listed) and kept.delta_table_sig

    asyncio.run(go())


@pytest.mark.timeout(120)
def test_a_base_listed_in_arrival_order_then_in_file_order_is_not_refused(history):
    """A relay lists a base's parts as they arrive, then (stored) in file order from the same
    index on: the client reads the new order anew, and checks that every part is listed only
    then, not on the answer it will read again."""
    from sparrowrl.transport.piece_table import PieceTable
    from sparrowrl.transport.server import make_app

    path, states = history
    info = Store(path).versions[0]
    table = PieceTable("base", 0, path / "bases" / info.base, info.base_bytes)
    active = {"on": True}
    app = make_app(
        path,
        TOKEN,
        signer=SIGNER,
        arriving=lambda what, v, start: table if (what, v) == ("base", 0) and active["on"] else None,
    )

    async def go():
        async with serving(app) as url, Client(url, token=WORKER, trust=SIGNER.verifier) as c:
            listing = await c.versions()
            entry = next(e for e in listing["versions"] if e["version"] == 0)
            size, step = info.base_bytes, info.base_part_bytes
            parts = [
                [i * step, min(step, size - i * step), h, i == len(info.base_parts) - 1, ""]
                for i, h in enumerate(info.base_parts)
            ]
            assert len(parts) >= 3
            table.add(parts[-1])  # the last part first: arrival order is not file order
            got = []

            def keep(p, data):
                got.append(p.offset)
                if len(got) == 1:  # midway the relay has it all, and lists in file order
                    active["on"] = False

            await c.base_parts(0, entry, keep)
            assert sorted(got) == [p[0] for p in parts] and not c.stats.refused

    asyncio.run(go())
