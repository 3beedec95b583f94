"""Transport over real sockets: auth, ranges, verified multi-stream fetch, faults and recovery."""

import asyncio
import hashlib
import json
import os
import socket
import subprocess
import threading
import time

import pytest
from safetensors.torch import save_file
from support.netfaults import Faults, FaultyProxy
from support.servers import EXE, TOKEN, Server, free_port, listen, next_version, paused_publish, start_server
from support.tensors import mutated, same

from sparrowrl.delta import apply_delta, state_hash
from sparrowrl.store.store import Store
from sparrowrl.transport.client import Client
from sparrowrl.transport.failover import FetchError


def run(coro):
    return asyncio.run(coro)


def test_every_endpoint_wants_the_token(history):
    async def go():
        async with Server(history[0]) as s, Client(s.url, token="") as anon, Client(s.url, token="wrong") as bad:
            for path in [
                "/v1/versions",
                "/v1/plan?to=3",
                "/v1/versions/2/manifest",
                "/v1/versions/2/delta",
                "/v1/versions/4/base",
                "/nowhere",
            ]:
                for c in (anon, bad):
                    async with c.servers.session.get(s.url + path) as r:
                        assert r.status == 401, path
                        assert r.headers["WWW-Authenticate"].startswith("Bearer")

    run(go())


def test_ranges_and_bad_requests(history):
    path, _ = history
    store = Store(path)
    raw = (path / "deltas" / store.versions[3].delta).read_bytes()

    async def go():
        async with Server(path) as s, Client(s.url, token=TOKEN) as c:

            def get(p, **h):
                return c.servers.session.get(s.url + p, headers=h)

            async with get("/v1/versions/3/delta", Range="bytes=10-99") as r:
                assert r.status == 206 and await r.read() == raw[10:100]
                assert r.headers["Content-Range"] == f"bytes 10-99/{len(raw)}"
            for bad in ["bytes=999999999-", "bytes=50-10", "bytes=abc"]:
                async with get("/v1/versions/3/delta", Range=bad) as r:
                    assert 400 <= r.status < 500, bad
            for p in [
                "/v1/versions/99/delta",
                "/v1/versions/-1/delta",
                "/v1/versions/0/delta",
                "/v1/versions/3/base",
                "/v1/plan?to=abc",
                "/v1/plan",
            ]:
                async with get(p) as r:
                    assert 400 <= r.status < 500, p
            for p in [
                "/v1/versions/..%2F..%2Fstore.json/delta",
                "/v1/versions/3/../../store.json",
                "/v1/versions/3/delta/../../../../store.json",
                "/../store.json",
                "/v1/versions/%2e%2e/delta",
            ]:
                status, body = await raw_get(s.port, p)  # as sent: a client library would normalize `..` away
                assert 400 <= status < 500 and b'"base_every"' not in body, (p, status)

    run(go())


async def raw_get(port: int, target: str) -> tuple[int, bytes]:
    """One GET with the request target exactly as given, on a socket of its own."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"GET {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n".encode()
    )
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return int(answer.split(b" ", 2)[1]), answer


@pytest.mark.parametrize("streams", [1, 4])
def test_fetch_by_chain_and_by_base(history, streams):
    path, states = history

    async def go():
        async with Server(path) as s, Client(s.url, token=TOKEN, streams=streams, group_bytes=1) as c:
            held = {k: v.clone() for k, v in states[1].items()}
            state, h = await c.advance(3, (1, held, state_hash(held)))
            assert same(state, states[3]) and h == state_hash(states[3])
            assert (await c.json("/v1/plan", params={"to": 3, "from": 1}))["route"] == "chain"
            state, h = await c.advance(6)  # from nothing: base v4 + deltas 5, 6
            assert same(state, states[6])

    run(go())


def test_a_server_that_ignores_range_still_serves_each_piece():
    """A proxy that drops the Range header answers 200 with the whole file: each stream skips to
    its piece (in bounded reads) and every piece still verifies in place."""
    from aiohttp import web

    from sparrowrl.transport.streams import Piece

    data = os.urandom(3 << 20)
    pieces = [
        Piece(o, 1 << 20, hashlib.sha256(data[o : o + (1 << 20)]).hexdigest()) for o in range(0, len(data), 1 << 20)
    ]
    asked = []

    async def whole(request):
        asked.append(request.headers.get("Range"))
        return web.Response(body=data)

    async def go():
        app = web.Application()
        app.router.add_get("/file", whole)
        runner, url = await listen(app)
        try:
            async with Client(url, token=TOKEN, streams=2, group_bytes=1) as c:
                got = await c.download("/file", len(data), pieces)
                assert bytes(got) == data and c.stats.refetched == 0
        finally:
            await runner.cleanup()

    run(go())
    assert sorted(asked) == ["bytes=0-1048575", "bytes=1048576-2097151", "bytes=2097152-3145727"]


@pytest.mark.network
def test_connection_killed_mid_transfer_resumes(history):
    path, states = history

    async def go():
        async with Server(path) as s:
            faults = Faults(cut_after=3000, cuts=5)  # requests span several pieces: cuts land mid-request
            async with (
                FaultyProxy(s.port, faults) as proxy,
                Client(proxy.url, token=TOKEN, streams=2, backoff=0.01) as c,
            ):
                state, _ = await c.advance(6)
                assert same(state, states[6])
                # every cut happened; those that hit a request in flight were resumed (one that hits a
                # kept-alive connection between requests is aiohttp's to reconnect)
                assert faults.cuts == 0 and c.stats.retries >= 1
                size = Store(path).plan(None, 6).bytes
                assert c.stats.bytes <= size  # verified pieces were kept, never fetched twice

    run(go())


@pytest.mark.network
def test_corrupted_chunk_is_refetched_never_applied(history):
    path, states = history

    async def go():
        async with Server(path) as s:
            faults = Faults(corrupt_at=60, corruptions=3)
            async with (
                FaultyProxy(s.port, faults) as proxy,
                Client(proxy.url, token=TOKEN, streams=1, backoff=0.01, group_bytes=1) as c,
            ):
                held = {k: v.clone() for k, v in states[4].items()}
                state, _ = await c.advance(6, (4, held, state_hash(held)))
                assert same(state, states[6]) and faults.corruptions == 0 and c.stats.refetched >= 1

    run(go())


@pytest.mark.network
def test_gives_up_with_a_clear_error(history):
    path, states = history

    async def go():
        async with Server(path) as s:
            async with (
                FaultyProxy(s.port, Faults(corrupt_at=60, corruptions=10**6)) as proxy,
                Client(proxy.url, token=TOKEN, streams=1, attempts=3, backoff=0.01) as c,
            ):
                held = {k: v.clone() for k, v in states[4].items()}
                before = {k: v.clone() for k, v in held.items()}
                with pytest.raises(FetchError, match="failed their checksum 3 times"):
                    await c.advance(5, (4, held, state_hash(held)))
                assert same(held, before)  # nothing the caller holds was touched
        async with Client("http://127.0.0.1:9", token=TOKEN, attempts=2, backoff=0.01) as c:
            with pytest.raises(FetchError, match="gave up after 2 attempts"):
                await c.versions()

    run(go())


def test_fallback_to_the_next_server(history):
    path, states = history

    async def go():
        async with Server(path) as s, Client(["http://127.0.0.1:9", s.url], token=TOKEN, backoff=0.01) as c:
            state, _ = await c.advance(5)
            assert same(state, states[5])

    run(go())


def test_long_poll_wakes_on_a_new_version(history, tmp_path, rng):
    import shutil

    path = tmp_path / "s"
    shutil.copytree(history[0], path)
    newest = Store(path).newest

    async def go():
        async with Server(path) as s, Client(s.url, token=TOKEN) as c:
            t0 = time.monotonic()
            assert (await c.versions(after=newest, wait=0.3))["newest"] == newest
            assert time.monotonic() - t0 >= 0.3
            assert (await c.versions(after=newest - 1, wait=30))["newest"] == newest  # immediate
            async with Client(s.url, token=TOKEN, read_timeout=0.2, attempts=1) as impatient:
                # a long-poll held longer than the read timeout is not a stalled read
                assert (await impatient.versions(after=newest, wait=0.5))["newest"] == newest
            state = Store(path).materialize(newest)
            adder = threading.Timer(0.5, lambda: Store(path).add(mutated(rng, state, 0.01)))
            adder.start()
            t0 = time.monotonic()
            listing = await c.versions(after=newest, wait=30)
            adder.join()
            # it wakes as soon as the new version is being written, or once it is stored
            assert newest + 1 in listing["producing"] or listing["newest"] == newest + 1
            assert time.monotonic() - t0 < 20

    run(go())


def test_long_poll_waits_for_a_base_snapshot(history, tmp_path, rng):
    """Full sync waits for a version's snapshot, which the trainer writes after its delta: one
    long-poll, not a polling loop."""
    import shutil

    path = tmp_path / "s"
    shutil.copytree(history[0], path)
    store = Store(path)
    new = mutated(rng, store.materialize(store.newest), 0.01)
    v = store.add(new).version
    assert not store.versions[v].base  # not a base version: written below, as full sync does

    async def go():
        async with Server(path) as s, Client(s.url, token=TOKEN) as c:
            writer = threading.Timer(0.3, lambda: Store(path).snapshot(v, new))
            writer.start()
            listing = await c.versions(base=v, wait=30)
            writer.join()
            assert next(e for e in listing["versions"] if e["version"] == v)["base"] is not None

    run(go())


def test_long_poll_waits_for_a_version_to_be_stored(history, tmp_path, rng):
    """A relay that mirrored a delta while it was written waits for its index entry: one
    long-poll (`delta=V`), through the version's whole production, not a polling loop."""
    import shutil

    path = tmp_path / "s"
    shutil.copytree(history[0], path)
    store = Store(path)
    newest, state = store.newest, store.materialize(store.newest)

    async def go():
        async with Server(path) as s, Client(s.url, token=TOKEN) as c:
            assert (await c.versions(delta=newest, wait=30))["newest"] == newest  # stored: at once
            adder = threading.Timer(0.3, lambda: Store(path).add(mutated(rng, state, 0.01)))
            adder.start()
            listing = await c.versions(delta=newest + 1, wait=30)  # also while it is only being written
            adder.join()
            entry = next(e for e in listing["versions"] if e["version"] == newest + 1)
            assert entry["delta"]["sha256"] == Store(path).versions[newest + 1].delta_sha256

    run(go())


@pytest.mark.e2e
def test_server_restart_mid_fetch(history):
    """The server dies with the client's fetch under way and comes back: the fetch completes."""
    path, states = history
    port = free_port()
    server = start_server(path, port)

    async def go():
        nonlocal server
        async with Client(f"http://127.0.0.1:{port}", token=TOKEN, streams=2, backoff=0.1, attempts=12) as c:
            held = {k: v.clone() for k, v in states[4].items()}
            plan = await c.json("/v1/plan", params={"to": 6, "from": 4})  # the fetch has begun...
            assert plan["deltas"] == [5, 6]
            server.kill()  # ...and the server goes away
            server.wait()
            task = asyncio.create_task(c.advance(6, (4, held, state_hash(held))))
            await asyncio.sleep(1.0)
            assert not task.done()
            server = await asyncio.to_thread(start_server, path, port)
            state, _ = await task
            assert same(state, states[6]) and c.stats.retries >= 1

    try:
        run(go())
    finally:
        server.kill()


@pytest.mark.e2e
def test_curl_lists_versions_and_fetches_a_chunk_range(history):
    path, _ = history
    port = free_port()
    server = start_server(path, port)
    try:
        auth = ["-H", f"Authorization: Bearer {TOKEN}"]
        base = f"http://127.0.0.1:{port}"
        listing = json.loads(subprocess.check_output(["curl", "-sf", *auth, f"{base}/v1/versions"]))
        assert listing["newest"] == 6
        info = json.loads(subprocess.check_output(["curl", "-sf", *auth, f"{base}/v1/versions/5/manifest"]))
        chunk = info["manifest"]["chunks"][0]
        lo, hi = chunk["offset"], chunk["offset"] + chunk["length"] - 1
        data = subprocess.check_output(["curl", "-sf", *auth, "-r", f"{lo}-{hi}", f"{base}/v1/versions/5/delta"])
        assert hashlib.sha256(data).hexdigest() == chunk["sha256"]
        code = subprocess.check_output(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", f"{base}/v1/versions"])
        assert code == b"401"
    finally:
        server.kill()


@pytest.mark.e2e
def test_tls_and_the_fetch_command(history, tmp_path):
    path, states = history
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            key,
            "-out",
            cert,
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    server = start_server(path, port, "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        save_file(states[2], tmp_path / "v2.safetensors")
        env = dict(os.environ, SPARROWRL_TOKEN=TOKEN)
        p = subprocess.run(
            [
                str(EXE),
                "fetch",
                f"https://127.0.0.1:{port}",
                "--version",
                "5",
                "--base",
                tmp_path / "v2.safetensors",
                "--base-version",
                "2",
                "--ca-cert",
                cert,
                "-o",
                tmp_path / "v5.safetensors",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr
        from safetensors.torch import load_file

        assert same(load_file(str(tmp_path / "v5.safetensors")), states[5])
        p = subprocess.run(
            [str(EXE), "fetch", f"https://127.0.0.1:{port}", "--version", "5", "-o", tmp_path / "x.safetensors"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 1 and not (tmp_path / "x.safetensors").exists()  # untrusted certificate
    finally:
        server.kill()


@pytest.mark.e2e
def test_serve_refuses_public_address_without_token(history):
    p = subprocess.run(
        [str(EXE), "serve", str(history[0]), "--host", "0.0.0.0", "--port", "1"],
        env={k: v for k, v in os.environ.items() if k != "SPARROWRL_TOKEN"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1 and "without SPARROWRL_TOKEN" in p.stderr


def test_cut_through_first_chunk_arrives_before_the_writer_finishes(history, tmp_path, rng):
    """The trainer publishes tensor by tensor; a client reads chunks while later tensors are
    still being diffed: the writer waits for the client's first verified chunk before going on."""
    path, store, v0, old, new = next_version(history, tmp_path, rng)
    got_first, writer_done = threading.Event(), threading.Event()

    async def go():
        async with Server(path) as s, Client(s.url, token=TOKEN) as c:
            t = paused_publish(store, old, new, got_first, writer_done)
            listing = await c.versions(after=v0, wait=30)
            assert listing["producing"] == [v0 + 1] or listing["newest"] == v0 + 1
            seen = []

            def on_piece(piece, data):
                seen.append((len(data), writer_done.is_set()))
                if len(seen) >= 2:  # header, then a chunk
                    got_first.set()

            d = await c.delta(v0 + 1, on_piece)
            await asyncio.to_thread(t.join)
            assert any(not done for _, done in seen[1:2]), "first chunk came only after the writer finished"
            held = {k: v.clone() for k, v in old.items()}
            assert apply_delta(d, held, base_hash=store.versions[v0].state_hash) == state_hash(new)
            assert Store(path).versions[v0 + 1].state_hash == state_hash(new)

    run(go())


@pytest.mark.network
def test_cut_through_resumes_after_cuts(history):
    path, states = history

    async def go():
        async with (
            Server(path) as s,
            FaultyProxy(s.port, Faults(cut_after=5000, cuts=3)) as proxy,
            Client(proxy.url, token=TOKEN, backoff=0.01) as c,
        ):
            pieces = {}
            d = await c.delta(5, lambda p, data: pieces.setdefault(p.offset, data))
            assert (
                b"".join(pieces[k] for k in sorted(pieces))
                == d.data
                == (path / "deltas" / Store(path).versions[5].delta).read_bytes()
            )
            assert c.stats.retries >= 1

    run(go())


@pytest.mark.network
def test_streams_bind_the_given_local_ports(history):
    """For per-flow shaped links (hack/wan): stream i connects from local_ports[i]."""
    path, states = history
    ports = [free_port(), free_port()]

    async def go():
        async with (
            Server(path) as s,
            FaultyProxy(s.port, Faults()) as proxy,
            Client(proxy.url, token=TOKEN, streams=2, local_ports=ports, group_bytes=1) as c,
        ):
            state, _ = await c.advance(6)
            assert same(state, states[6]) and set(ports) <= proxy.peer_ports

    run(go())


def test_a_local_port_in_time_wait_is_bound_again(history):
    """A stream's fixed port whose last connection this side closed (TIME_WAIT for a minute)
    must still connect: the relay once stalled for minutes on exactly this."""
    path, states = history
    port = free_port()

    async def go():
        async with Server(path) as s:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the client's own sockets
            sock.bind(("127.0.0.1", port))
            sock.connect(("127.0.0.1", s.port))
            sock.close()  # active close: this side keeps (port → server) in TIME_WAIT
            async with Client(s.url, token=TOKEN, streams=1, local_ports=[port], attempts=2, backoff=0.01) as c:
                state, _ = await c.advance(6)
            assert same(state, states[6])

    run(go())


def _hold(port: int) -> socket.socket:
    """The port taken as another process takes it: bound without SO_REUSEADDR, and listening."""
    sock = socket.socket()
    sock.bind(("0.0.0.0", port))
    sock.listen()
    return sock


def test_a_stream_whose_local_port_is_taken_waits_for_it(history):
    """Another process holds a stream's fixed port (an ephemeral connection of its own that the
    kernel happened to give that port): the stream waits for it, without using up its attempts
    (2 here; the WAN benchmark once failed after 40), and goes on once the port is free."""
    path, states = history
    port = free_port()

    async def go():
        held = _hold(port)
        asyncio.get_running_loop().call_later(1.0, held.close)
        async with (
            Server(path) as s,
            Client(s.url, token=TOKEN, streams=1, local_ports=[port], attempts=2, backoff=0.01) as c,
        ):
            state, _ = await c.advance(6)
        assert same(state, states[6]) and c.stats.port_waits >= 1 and c.stats.retries == 0

    run(go())


@pytest.mark.timeout(60)  # the wait is bounded: an unbounded one fails here
def test_a_local_port_that_stays_taken_is_named_after_a_bounded_wait(history):
    path, _ = history
    port = free_port()

    async def go():
        held = _hold(port)
        try:
            async with (
                Server(path) as s,
                Client(s.url, token=TOKEN, streams=1, local_ports=[port], attempts=2, port_wait=1.0) as c,
            ):
                with pytest.raises(FetchError, match=rf"local port {port} stayed taken for 1 s .*--local-ports"):
                    await c.advance(6)
                assert c.stats.retries == 0  # waiting, not failing: the attempts were not spent
        finally:
            held.close()

    run(go())


def test_a_rate_cap_paces_the_download(history):
    """`rate_mbit` (a region's bandwidthMbit in a job) holds all streams together to the cap: a
    lower bound on the time taken, which a loaded machine can only lengthen."""
    path, states = history
    rate_mbit = 4.0

    async def go():
        async with Server(path) as s, Client(s.url, token=TOKEN, streams=4, rate_mbit=rate_mbit) as c:
            t0 = time.perf_counter()
            state, _ = await c.advance(4)  # base v4: about 0.6 MB
            took = time.perf_counter() - t0
            assert same(state, states[4])
            want = c.stats.bytes * 8 / (rate_mbit * 1e6)
            assert took >= 0.9 * want - 0.1, (took, want)  # the bucket starts with 0.1 s of credit

    run(go())
