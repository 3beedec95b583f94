"""Relays: fetch once across the 'WAN', serve a region cut-through, and fall back when killed."""

import asyncio
import os
import resource
import shutil
import subprocess
import threading

import aiohttp
import numpy as np
import pytest
from safetensors.torch import load as load_safetensors
from support.netfaults import Faults, FaultyProxy
from support.servers import (
    EXE,
    TOKEN,
    Server,
    free_port,
    get,
    listen,
    next_version,
    paused_publish,
    serving,
    start_server,
)
from support.tensors import mutate, mutated, random_tensor, same
from support.wait import until_async

from sparrowrl.delta import apply_delta, state_hash
from sparrowrl.store.index import BASE_PART
from sparrowrl.store.store import Store
from sparrowrl.transport.client import Client
from sparrowrl.transport.relay import Relay, make_relay_app


class RelayServer:
    def __init__(self, upstream, mirror, keep=8, **client_kw):
        self.relay = Relay([upstream], mirror, keep=keep, token=TOKEN, backoff=0.01, **client_kw)

    async def __aenter__(self):
        self.runner, self.url = await listen(make_relay_app(self.relay, TOKEN))
        async with asyncio.timeout(60):
            await self.relay.synced.wait()
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


@pytest.mark.network
@pytest.mark.timeout(120)
def test_a_worker_that_starts_before_its_relay_has_synced_waits_for_it(history, tmp_path):
    """A relay that has not reached its upstream yet asks its workers to come back (503 with
    Retry-After) instead of sending them to the origin: pods start together, and each worker
    would otherwise pull a whole base across the WAN."""
    path, states = history

    async def go():
        async with Server(path) as origin, FaultyProxy(origin.port, Faults(cut_after=0, cuts=10**6)) as wan:
            relay = Relay([wan.url], tmp_path / "mirror", token=TOKEN, backoff=0.01)
            runner, url = await listen(make_relay_app(relay, TOKEN))
            try:
                async with Client([url, origin.url], token=TOKEN, backoff=0.01) as worker:
                    fetch = asyncio.create_task(worker.advance(6))
                    await until_async(lambda: worker.stats.requests >= 5, 60, "the worker's requests to the relay")
                    assert not relay.synced.is_set() and not fetch.done()
                    wan.faults.cuts = 0  # the upstream comes up
                    async with asyncio.timeout(60):
                        state, _ = await fetch
                    assert same(state, states[6])
                    assert {server for _, server, _ in worker.stats.sources} == {url}  # nothing from the origin
                    assert worker.servers.server == 0
            finally:
                await runner.cleanup()

    asyncio.run(go())


@pytest.mark.network
def test_relay_fetches_once_and_serves_its_region(history, tmp_path):
    """Deltas cross the WAN as the origin makes them; a base snapshot only when a worker first
    asks for one, and once however many ask."""
    path, states = history

    async def go():
        async with (
            Server(path) as origin,
            FaultyProxy(origin.port, Faults()) as wan,
            RelayServer(wan.url, tmp_path / "mirror") as relay,
        ):
            mirrored = wan.bytes_down
            base = Store(path).versions[4].base_bytes
            assert mirrored < base  # deltas only: no worker has asked for a base yet
            assert not list((tmp_path / "mirror" / "bases").iterdir())
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as curl:
                # only listing its parts (GET base/pieces) fetches a base: not a HEAD, not the file
                async with curl.head(f"{relay.url}/v1/versions/4/base/pieces") as r:
                    assert r.status == 503
                async with curl.get(f"{relay.url}/v1/versions/4/base") as r:
                    assert r.status == 503 and "base/pieces fetches it" in await r.text()
            assert not relay.relay.bases and wan.bytes_down == mirrored
            workers = [Client(relay.url, token=TOKEN, streams=2) for _ in range(3)]
            for w in workers:
                await w.__aenter__()
            results = await asyncio.gather(*(w.advance(6) for w in workers))
            for w in workers:
                await w.__aexit__(None, None, None)
            assert all(same(s, states[6]) for s, _ in results)
            served = sum(w.stats.bytes for w in workers)
            assert served >= 3 * Store(path).plan(None, 6).bytes
            # three workers starting from base 4: the base crossed the WAN once, on the first request
            assert base <= wan.bytes_down - mirrored < base + 64 * 1024
            listing = await Client(relay.url, token=TOKEN).__aenter__()
            assert (await listing.versions())["newest"] == 6
            await listing.__aexit__(None, None, None)

    asyncio.run(go())


def test_relay_is_cut_through(history, tmp_path, rng):
    """A worker behind the relay gets the first chunk while the trainer is still encoding."""
    path, store, v0, old, new = next_version(history, tmp_path, rng)
    got_first, writer_done = threading.Event(), threading.Event()

    async def go():
        async with (
            Server(path) as origin,
            RelayServer(origin.url, tmp_path / "mirror") as relay,
            Client(relay.url, token=TOKEN) as worker,
        ):
            t = paused_publish(store, old, new, got_first, writer_done)

            async def listed() -> bool:  # a long-poll of 5 s
                got = await worker.versions(after=v0, wait=5)
                return v0 + 1 in got["producing"] + [got["newest"]]

            await until_async(listed, 60, f"v{v0 + 1} listed", every=0)
            await until_async(
                lambda: len(getattr(relay.relay.tables.get(v0 + 1), "pieces", [])) >= 2,
                60,
                "the relay mirrors two pieces",
            )
            # meanwhile, a client that listed its pieces elsewhere (the origin, before falling back
            # here) gets only bytes that have verified at the relay, at once
            offset, length, *_ = relay.relay.tables[v0 + 1].pieces[1]
            url = f"{relay.url}/v1/versions/{v0 + 1}/delta"
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as curl:
                async with curl.get(url, headers={"Range": f"bytes={offset}-{offset + length - 1}"}) as r:
                    assert (r.status, r.headers["Content-Range"]) == (206, f"bytes {offset}-{offset + length - 1}/*")
                    early = await r.read()
                async with curl.get(url, headers={"Range": f"bytes=0-{10**9}"}) as r:
                    assert r.status == 503 and "not reached this relay yet" in await r.text()
                async with curl.get(url) as r:  # its size is not known yet
                    assert r.status == 503
            seen = []

            def on_piece(piece, data):
                seen.append(writer_done.is_set())
                if len(seen) >= 2:
                    got_first.set()

            d = await worker.delta(v0 + 1, on_piece)
            await asyncio.to_thread(t.join)
            assert seen[1] is False, "the worker's first chunk came only after the trainer finished"
            assert early == d.data[offset : offset + length]
            held = {k: v.clone() for k, v in old.items()}
            assert apply_delta(d, held, base_hash=store.versions[v0].state_hash) == state_hash(new)

    asyncio.run(go())


@pytest.mark.e2e
def test_relay_killed_workers_fall_back(history, tmp_path):
    path, states = history
    origin_port, relay_port = free_port(), free_port()
    origin = start_server(path, origin_port)
    env = dict(os.environ, SPARROWRL_TOKEN=TOKEN)
    relay = subprocess.Popen(
        [
            str(EXE),
            "relay",
            "--upstream",
            f"http://127.0.0.1:{origin_port}",
            "--port",
            str(relay_port),
            "--cache",
            str(tmp_path / "mirror"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        async def go():
            urls = [f"http://127.0.0.1:{relay_port}", f"http://127.0.0.1:{origin_port}"]
            async with Client(urls, token=TOKEN, backoff=0.05) as c:

                async def mirrored() -> bool:  # the newest version, at the relay
                    try:
                        if (await c.json("/v1/versions"))["newest"] == 6 and c.servers.server == 0:
                            return True
                    except Exception:
                        pass
                    c.servers.server = 0
                    return False

                await until_async(mirrored, 60, "the relay listing v6", every=0.1)
                state, _ = await c.advance(6)
                assert same(state, states[6]) and c.servers.server == 0  # served by the relay
                relay.kill()
                relay.wait()
                state, _ = await c.advance(5)
                assert same(state, states[5]) and c.servers.server == 1  # fell back to the origin

        asyncio.run(go())
    finally:
        relay.kill()
        origin.kill()


def test_pieces_in_arrival_order_then_in_file_order(history):
    """A relay lists a delta's pieces as they verify, in any order; once stored it lists them in
    file order. A worker that switches lists midway (or servers) lists anew and loses nothing."""
    from sparrowrl.auth.signing import Signer
    from sparrowrl.transport.piece_table import PieceTable
    from sparrowrl.transport.server import make_app

    path, states = history
    table = PieceTable("delta", 5, path / "deltas" / Store(path).versions[5].delta)  # its pieces are in that file
    active = {"on": True}
    app = make_app(
        path,
        TOKEN,
        signer=Signer(TOKEN),
        arriving=lambda what, v, start: table if (what, v) == ("delta", 5) and active["on"] else None,
    )

    async def go():
        async with serving(app) as url, Client(url, token=TOKEN) as c:
            active["on"] = False
            in_file_order = (await c.json("/v1/versions/5/pieces"))["pieces"]
            active["on"] = True
            assert len(in_file_order) >= 3  # header, chunk(s), tail
            for p in reversed(in_file_order[1:]):  # the header last: as if it were slow to arrive
                table.add(p)

            async def switch():  # midway, the list turns to file order (as after a fallback to the origin)
                await until_async(lambda: len(got) >= 2, 60, "two pieces arrive")
                active["on"] = False
                table.close()

            got = []
            task = asyncio.create_task(switch())
            d = await c.delta(5, lambda p, data: got.append(p.offset))
            await task
            assert d.data == (path / "deltas" / Store(path).versions[5].delta).read_bytes()
            assert len(got) == len(set(got)) == len(in_file_order)  # each piece fetched once
            assert got[-1] == 0  # the header, first in file order, was listed and fetched last

    asyncio.run(go())


@pytest.fixture(scope="module")
def big_base(tmp_path_factory):
    """A store whose base snapshot (12 MB) spans many parts, and one delta after it."""
    rng = np.random.default_rng(5)
    path = tmp_path_factory.mktemp("big") / "s"
    states = [{"w": random_tensor(rng, "BF16", (3 * BASE_PART // 2000 + 7, 1000))}]
    states.append({"w": mutate(rng, states[0]["w"], 0.001)})
    store = Store.init(path, states[0], base_every=4)
    store.add(states[1])
    assert len(store.versions[0].base_parts) > 4
    return path, states


@pytest.mark.network
def test_relay_serves_a_base_cut_through(big_base, tmp_path):
    """A worker gets a base's first parts while its relay still fetches the rest over a slow
    WAN: a large model's base neither waits for its last byte nor runs into read timeouts.
    Plain HTTP gets verified bytes only, at once: a range that has not arrived is a 503."""
    path, states = big_base
    whole = (path / "bases" / "v00000000.safetensors").read_bytes()

    async def go():
        async with (
            Server(path) as origin,
            FaultyProxy(origin.port, Faults(rate=10e6)) as wan,
            RelayServer(wan.url, tmp_path / "mirror", streams=1) as relay,
            Client(relay.url, token=TOKEN, streams=2) as worker,
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as curl,
        ):
            entry = next(e for e in (await worker.versions())["versions"] if e["version"] == 0)
            buf, relay_busy = bytearray(len(whole)), []

            def keep(p, data):
                relay_busy.append(0 in relay.relay.bases)
                buf[p.offset : p.offset + p.length] = data

            crossed = wan.bytes_down
            download = asyncio.create_task(worker.base_parts(0, entry, keep))
            await until_async(lambda: relay_busy, 60, "the worker's first part")
            url = f"{relay.url}/v1/versions/0/base"
            async with curl.get(url, headers={"Range": "bytes=0-99"}) as r:  # in: the worker has it
                assert (r.status, r.headers["Content-Range"], await r.read()) == (
                    206,
                    f"bytes 0-99/{len(whole)}",
                    whole[:100],
                )
            async with curl.get(url, headers={"Range": "bytes=-100"}) as r:  # the last part: not yet
                assert r.status == 503 and "not reached this relay yet" in await r.text()
            async with curl.get(url, headers={"Range": "bytes=9-2"}) as r:
                assert r.status == 416
            await download
            assert relay_busy[0], "the worker's first part came only after the relay had the whole base"
            assert len(relay_busy) == len(entry["base"]["parts"])
            assert same(load_safetensors(bytes(buf)), states[0])
            assert len(whole) <= wan.bytes_down - crossed < len(whole) + 64 * 1024  # once, for everyone
            await until_async(lambda: 0 not in relay.relay.bases, 60, "the relay stores base v0")
            async with curl.get(url) as r:
                assert r.status == 200 and await r.read() == whole
            assert (tmp_path / "mirror" / "bases" / "v00000000.safetensors").read_bytes() == whole

    asyncio.run(go())


@pytest.mark.network
def test_a_base_the_relay_cannot_fetch_sends_workers_to_the_origin(history, tmp_path):
    """A failed fetch is answered with its error for a while: clients go to the origin instead
    of starting a fetch across the WAN each."""
    path, states = history

    async def go():
        async with (
            Server(path) as origin,
            FaultyProxy(origin.port, Faults()) as wan,
            RelayServer(wan.url, tmp_path / "mirror") as relay,
            Client([relay.url, origin.url], token=TOKEN, backoff=0.01) as worker,
        ):
            wan.faults.cut_after, wan.faults.cuts = 0, 10**6  # the relay's link fails after it synced
            state, _ = await worker.advance(6)
            assert same(state, states[6]) and worker.servers.server == 1
            failed = relay.relay.bases[4][0]
            assert failed.error
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as curl:
                async with curl.get(f"{relay.url}/v1/versions/4/base/pieces") as r:
                    assert r.status == 503 and failed.error in await r.text()
            assert relay.relay.bases[4][0] is failed  # no new fetch
            assert not list((tmp_path / "mirror" / "bases").iterdir())  # no partial file left behind

    asyncio.run(go())


@pytest.mark.network
def test_a_base_pruned_while_fetched_is_dropped(history, tmp_path):
    """The relay moves on while a slow base fetch is under way: the versions it serves leave
    its window, the fetch stops, no file is left behind, and its worker goes to the origin."""
    path = tmp_path / "s"
    shutil.copytree(history[0], path)
    store, states = Store(path), list(history[1])
    rng = np.random.default_rng(9)

    async def go():
        async with (
            Server(path) as origin,
            FaultyProxy(origin.port, Faults(rate=100e3)) as wan,
            RelayServer(wan.url, tmp_path / "mirror", keep=2) as relay,
            Client([relay.url, origin.url], token=TOKEN, backoff=0.01) as worker,
        ):
            fetch = asyncio.create_task(worker.advance(6))  # from base 4: six seconds over this link
            await until_async(lambda: 4 in relay.relay.bases, 60, "the relay starts fetching base v4")
            table = relay.relay.bases[4][0]
            for _ in range(3):  # v7, v8 (a base), v9: base 8 now serves the relay's two newest
                states.append(mutated(rng, states[-1], 0.02))
                await asyncio.to_thread(store.add, states[-1])
            state, _ = await fetch
            assert same(state, states[6]) and worker.servers.server == 1
            assert table.error and "dropped" in table.error
            assert 4 not in Store(tmp_path / "mirror").versions
            assert not list((tmp_path / "mirror" / "bases").iterdir())

    asyncio.run(go())


@pytest.mark.network
@pytest.mark.timeout(120)
def test_a_relay_behind_the_origins_pruned_versions_starts_again_from_its_newest_base(history, tmp_path):
    """The trainer prunes what no live worker needs (trainer/retention.py): a relay that was away
    meanwhile finds the versions after its own gone, starts its mirror again from the origin's
    newest base, and serves its workers from there."""
    path = tmp_path / "s"
    shutil.copytree(history[0], path)
    store, states = Store(path), list(history[1])
    rng = np.random.default_rng(11)

    async def go():
        async with Server(path) as origin:
            async with RelayServer(origin.url, tmp_path / "mirror"):
                assert Store(tmp_path / "mirror").newest == 6
            for _ in range(4):  # v7..v10, base 8; then pruned for workers at v9
                states.append(mutated(rng, states[-1], 0.02))
                await asyncio.to_thread(store.add, states[-1])
            assert store.prune(keep=2) == list(range(8))
            async with (
                RelayServer(origin.url, tmp_path / "mirror") as relay,
                Client(relay.url, token=TOKEN, backoff=0.01) as worker,
            ):
                assert sorted(Store(tmp_path / "mirror").versions) == [8, 9, 10]
                state, _ = await worker.advance(10)
                assert same(state, states[10]) and {s for _, s, _ in worker.stats.sources} == {relay.url}

    asyncio.run(go())


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_relay_raises_its_soft_limit_of_open_files(history, tmp_path):
    """Each stream of a worker holds a socket at the relay and, while a range is sent, the
    file: 128 workers of 4 streams take about 1,000 descriptors. Started under a soft limit of
    64 (1024 is a common default), a relay raises it to the hard limit and serves 96 streams
    held open at once. Out of descriptors, it answers 503 (its index unreadable) or 404 (a file
    it holds, as aiohttp answers an open that fails) and accepts no more connections: its
    workers would fall back to the origin, across the WAN."""
    path, _ = history
    origin_port, relay_port = free_port(), free_port()
    origin = start_server(path, origin_port)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    relay = subprocess.Popen(
        [str(EXE), "relay", "--upstream", f"http://127.0.0.1:{origin_port}", "--port", str(relay_port)],
        env=dict(os.environ, SPARROWRL_TOKEN=TOKEN),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard)),
    )
    url = f"http://127.0.0.1:{relay_port}"
    info = Store(path).versions[6]
    first = (path / "deltas" / info.delta).read_bytes()[:1000]
    try:

        def ready() -> bool:  # or ended: said below
            return get(f"{url}/readyz") == 200 or relay.poll() is not None

        async def go():
            await until_async(ready, 60, "the relay syncs")
            assert relay.poll() is None, relay.stdout.read()
            timeout = aiohttp.ClientTimeout(total=30)
            auth = {"Authorization": f"Bearer {TOKEN}"}
            workers = [aiohttp.ClientSession(headers=auth, timeout=timeout) for _ in range(96)]
            try:

                async def stream(s: aiohttp.ClientSession) -> bytes:
                    async with s.get(f"{url}/v1/versions") as r:  # its connection stays open
                        assert r.status == 200
                    await until_async(
                        lambda: len(os.listdir(f"/proc/{relay.pid}/fd")) > 96, 30, "96 streams open at once"
                    )
                    async with s.get(f"{url}/v1/versions/6/delta", headers={"Range": "bytes=0-999"}) as r:
                        assert r.status == 206, await r.text()
                        return await r.read()

                assert await asyncio.gather(*(stream(s) for s in workers)) == [first] * 96
            finally:
                for s in workers:
                    await s.close()

        asyncio.run(go())
        with open(f"/proc/{relay.pid}/limits") as f:
            assert any(line.startswith("Max open files") and line.split()[3] == str(hard) for line in f)
    finally:
        relay.kill()
        origin.kill()
        relay.wait()
        origin.wait()
