"""Hostile peers over real HTTP: query numbers, clients that hang up, bytes that are not UTF-8,
ports and TLS files that do not work, forged delta headers, servers whose listings lie. Every
server under test runs as a bounded child (tests/support/bounded.py)."""

import asyncio
import hashlib
import io
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from aiohttp import web
from safetensors.torch import save_file
from support.bounded import TOKEN, free_port, refused, serving, sparrowrl
from support.jobs import job
from support.tensors import random_tensor, stored, versions
from support.wait import until

from sparrowrl.auth.signing import Signer, base_statement, piece_statement
from sparrowrl.delta import DeltaFile, state_hash, write_delta
from sparrowrl.delta.bitview import bits
from sparrowrl.delta.errors import CorruptError
from sparrowrl.delta.frame import END, HEAD, MAGIC, TRAILER, pack_json, unpack_json
from sparrowrl.delta.statehash import format_hash, tensor_hash, tensor_key
from sparrowrl.store.index import BASE_PART
from sparrowrl.store.store import Store

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("address_space_limit")]


def make_store(path: Path, deltas: int) -> Path:
    """Version 0 (a base snapshot) and `deltas` versions after it."""
    rng = np.random.default_rng(5)
    stored(path, versions(rng, {"w": random_tensor(rng, "F32", (64, 64))}, deltas, 0.05), base_every=4)
    return path


def get(port: int, target: str, timeout: float = 10) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{target}", headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def send(port: int, request: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(request)
    return s


def long_poll(port: int, target: str) -> socket.socket:
    return send(port, f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())


def unanswered(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        return not s.recv(1)  # closed without an answer counts as answered: the poll did not wait
    except TimeoutError:
        return True


def wakes(pid: int, seconds: float) -> int:
    """How often the process's main thread (its event loop) woke up within `seconds`: an idle
    aiohttp server sleeps in epoll; a long-poll handler that is still waiting wakes every turn
    of its loop."""

    def switches() -> int:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(status.split("voluntary_ctxt_switches:")[1].split()[0])

    before = switches()
    time.sleep(seconds)
    return switches() - before


def goes_idle(pid: int, window: float, what: str) -> None:
    """Until the server's loop has a quiet `window` (one wake at most), for 25 s at most: the
    long-polls here ask to wait 60 s, so a handler that outlives its client never has one."""
    until(lambda: wakes(pid, window) <= 1, 25, what, every=0)


def holds(pid: int, path: Path) -> bool:
    """Whether the process has `path` open."""
    fds = Path(f"/proc/{pid}/fd")
    return any(os.path.realpath(f) == str(path.resolve()) for f in fds.iterdir() if f.is_symlink())


# 1. query numbers


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`sparrowrl serve` over versions 0 (base) and 1, with v2's delta being written (empty so far)."""
    path = make_store(tmp_path_factory.mktemp("query") / "s", deltas=1)
    Store(path).partial_path(2).write_bytes(b"")
    with serving("serve", path) as (p, port):
        yield port


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "target, name",
    [
        ("/v1/versions/2/pieces?wait=nan", "wait"),  # was: the deadline never passed, the handler spun forever
        ("/v1/versions?after=1&wait=nan", "wait"),
        ("/v1/versions?after=1&wait=inf", "wait"),
        ("/v1/versions?after=1&wait=1e999", "wait"),
        ("/v1/versions?after=1&wait=-1", "wait"),
        ("/v1/versions/0/base/pieces?wait=-inf", "wait"),
        ("/v1/versions?after=-5", "after"),  # was: slices from the end
        ("/v1/versions?base=-1", "base"),
        ("/v1/versions/1/pieces?after=-5", "after"),
        ("/v1/versions/0/base/pieces?after=-1", "after"),
        ("/v1/plan?to=-1", "to"),
        ("/v1/plan?to=1&from=-1", "from"),
        (f"/v1/versions?after={2**62 + 1}", "after"),
    ],
)
def test_query_numbers_must_be_finite_and_in_range(server, target, name):
    status, text = get(server, target)
    assert status == 400 and f"query parameter {name}=" in text, (status, text)


@pytest.mark.timeout(60)
def test_a_wait_past_the_limit_is_clamped_not_refused(server):
    assert get(server, "/v1/versions?after=0&wait=1e9")[0] == 200


# 2. long-polls whose client hangs up


@pytest.mark.timeout(90)
def test_a_version_long_poll_ends_when_its_client_leaves(tmp_path):
    with serving("serve", make_store(tmp_path / "s", deltas=1)) as (p, port):
        s = long_poll(port, "/v1/versions?after=1&wait=60")
        assert unanswered(s, 1.0) and wakes(p.pid, 1.0) > 1  # waiting for v2, polling the store
        s.close()
        goes_idle(p.pid, 1.0, "the handler to stop polling after its client left")


@pytest.mark.timeout(90)
def test_a_pieces_long_poll_ends_when_its_client_leaves(tmp_path):
    path = make_store(tmp_path / "s", deltas=1)
    partial = Store(path).partial_path(2)
    partial.write_bytes(b"")  # v2's delta, being written
    with serving("serve", path) as (p, port):
        s = long_poll(port, "/v1/versions/2/pieces?after=0&wait=60")
        assert unanswered(s, 1.0) and holds(p.pid, partial)
        s.close()
        goes_idle(p.pid, 1.0, "the handler to stop polling after its client left")
        assert not holds(p.pid, partial)


@pytest.mark.timeout(150)
def test_a_relay_base_long_poll_ends_when_its_client_leaves(tmp_path):
    """At a relay still fetching a base (capped at 125 B/s, so its first part takes minutes),
    a client waiting for parts leaves: the relay's handler stops waiting for them."""
    with serving("serve", make_store(tmp_path / "s", deltas=0)) as (_, origin):
        with serving("relay", "--upstream", f"http://127.0.0.1:{origin}", "--rate-mbit", "0.001") as (p, port):
            until(
                lambda: (
                    get(port, "/v1/versions")[0] == 200
                    and json.loads(get(port, "/v1/versions")[1])["versions"][0]["base"]
                ),
                60,
                "the relay listing the origin's base",
                every=0.2,
            )
            s = long_poll(port, "/v1/versions/0/base/pieces?after=0&wait=60")
            assert unanswered(s, 2.0)
            s.close()
            goes_idle(p.pid, 3.0, "the handler to stop waiting after its client left")


# 3. bytes that are not UTF-8


@pytest.mark.timeout(60)
def test_an_authorization_header_that_is_not_utf8_is_unauthorized(tmp_path):
    with serving("serve", make_store(tmp_path / "s", deltas=0)) as (p, port):
        s = send(port, b"GET /v1/versions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \xff\xfe\r\n\r\n")
        s.settimeout(10)
        assert s.recv(64).startswith(b"HTTP/1.1 401 "), "expected 401"
        s.close()
        p.terminate()
        log = p.communicate(timeout=30)[0]
    assert "Traceback" not in log and "Error handling request" not in log, log


# 4. ports and TLS files


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["serve", "relay", "trainer", "worker"])
def test_a_port_in_use_is_named(tmp_path, command):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        refused(sparrowrl(*role_args(tmp_path, command), "--port", port, timeout=60), f"127.0.0.1:{port}", "in use")
    assert not (tmp_path / "state").exists()  # a trainer checks its address before it writes its state


def role_args(tmp_path: Path, command: str) -> list:
    if command == "serve":
        return ["serve", make_store(tmp_path / "s", deltas=0)]
    if command == "relay":
        return ["relay", "--upstream", "http://127.0.0.1:9"]
    if command == "trainer":
        (tmp_path / "j.yaml").write_text(json.dumps(job()))
        return ["trainer", tmp_path / "j.yaml", "--state-dir", tmp_path / "state"]
    return ["worker", "--trainer", "http://127.0.0.1:9", "--name", "w"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["serve", "relay", "trainer", "worker"])
@pytest.mark.parametrize("port", [0, 70000, -1])
def test_a_port_out_of_range_is_named(tmp_path, command, port):
    refused(sparrowrl(*role_args(tmp_path, command), f"--port={port}", timeout=60), "--port", str(port), "out of range")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "flag,value,why",
    [
        ("--pace-tokens-per-s", "nan", "out of range"),
        ("--pace-tokens-per-s", "0", "out of range"),
        ("--local-ports", "1,x", "not comma-separated port numbers"),
        ("--local-ports", "70000", "out of range"),
    ],
)
def test_a_worker_flag_out_of_range_is_named(tmp_path, flag, value, why):
    refused(sparrowrl(*role_args(tmp_path, "worker"), f"{flag}={value}", timeout=60), flag, why)


@pytest.mark.timeout(120)
def test_tls_files_that_do_not_work_are_named(tmp_path):
    store = make_store(tmp_path / "s", deltas=0)
    junk, missing = tmp_path / "junk.pem", tmp_path / "missing.pem"
    junk.write_text("not a certificate\n")

    def serve(cert, key):
        return sparrowrl("serve", store, "--port", free_port(), "--tls-cert", cert, "--tls-key", key, timeout=60)

    refused(serve(missing, junk), "--tls-cert", str(missing), "No such file")
    refused(serve(junk, missing), "--tls-key", str(missing), "No such file")
    refused(serve(junk, junk), f"--tls-cert {junk}", f"--tls-key {junk}")
    relay = sparrowrl(
        "relay", "--upstream", "http://127.0.0.1:9", "--port", free_port(), "--ca-cert", missing, timeout=60
    )
    refused(relay, "--ca-cert", str(missing), "No such file")


# 5. a forged delta header


def forged_duplicate(t: torch.Tensor) -> bytes:
    """A delta over the state {"a": t} whose header lists 'a' twice, with every checksum
    re-signed and every hash made to agree with that table: before duplicates were refused,
    `delta apply` took it and printed a "verified" hash that its output does not have."""
    buf = io.BytesIO()
    write_delta(
        buf,
        {"a": t, "b": t},
        {"a": t, "b": t},
        base_version=0,
        base_hash=state_hash({"a": t, "b": t}),
        target_version=1,
    )
    data = buf.getvalue()
    _, version, n = HEAD.unpack_from(data)
    header = json.loads(unpack_json(data[HEAD.size : HEAD.size + n], version))
    offset, length, _, _ = TRAILER.unpack_from(data, len(data) - TRAILER.size)
    manifest = json.loads(unpack_json(data[offset : offset + length], version))
    assert not manifest["chunks"]  # nothing changed: no chunk offsets to move
    header["tensors"][1][0] = "a"
    seen = format_hash(2 * tensor_hash(tensor_key("a", t), bits(t)))  # the base as that table sees it
    header["base_hash"] = manifest["base_hash"] = manifest["target_hash"] = seen
    raw_header = pack_json(header, version)
    manifest["header_sha256"] = hashlib.sha256(raw_header).hexdigest()
    raw_manifest = pack_json(manifest, version)
    head = HEAD.pack(MAGIC, version, len(raw_header)) + raw_header + hashlib.sha256(raw_header).digest()
    return head + raw_manifest + TRAILER.pack(len(head), len(raw_manifest), hashlib.sha256(raw_manifest).digest(), END)


@pytest.mark.timeout(120)
def test_a_header_that_lists_a_tensor_twice_is_refused(tmp_path, rng):
    t = random_tensor(rng, "F32", (30, 20))
    forged = forged_duplicate(t)
    with pytest.raises(CorruptError, match="header: .*tensor 'a' is listed twice"):
        DeltaFile(forged)
    save_file({"a": t}, tmp_path / "base.safetensors")
    (tmp_path / "d.spd").write_bytes(forged)
    out = tmp_path / "out.safetensors"
    refused(
        sparrowrl("delta", "apply", tmp_path / "base.safetensors", tmp_path / "d.spd", "-o", out),
        "tensor 'a' is listed twice",
    )
    assert not out.exists()


# 6. servers whose listings lie


@contextmanager
def hostile(answers: dict):
    """An HTTP server in this process that answers GET PATH with answers[PATH] as JSON, whatever
    the query, or with answers[PATH](request) where that is a function; yields its URL."""

    async def answer(request: web.Request) -> web.Response:
        if request.path not in answers:
            raise web.HTTPNotFound()
        a = answers[request.path]
        return a(request) if callable(a) else web.json_response(a)

    app = web.Application()
    app.router.add_get("/{path:.*}", answer)
    runner = web.AppRunner(app)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def listing(base: dict | None) -> dict:
    return {
        "newest": 1,
        "base_every": 4,
        "producing": [],
        "versions": [
            {"version": 0, "state_hash": "0" * 16, "changed": 0, "delta": None, "base": base},
            {
                "version": 1,
                "state_hash": "1" * 16,
                "changed": 3,
                "delta": {"bytes": 100, "sha256": "a" * 64},
                "base": None,
            },
        ],
    }


def huge_base(size: int) -> dict:
    """Signed with the job's key: a trainer's numbers are bounded too."""
    parts = ["a" * 64] * -(-size // BASE_PART)
    sig = Signer(TOKEN).sign(base_statement(0, "0" * 16, size, BASE_PART, parts))
    return {"bytes": size, "part_bytes": BASE_PART, "parts": parts, "sig": sig}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "size, words",
    [
        (1 << 41, ["/v1/versions: versions.0.base.bytes", "less than or equal to"]),  # past any file a peer may list
        (1 << 40, ["base v0", f"{1 << 40:,} bytes", "memory free here"]),  # listable, but more than this machine has
    ],
)
def test_a_base_bigger_than_memory_is_refused_before_allocating(tmp_path, size, words):
    assert os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") < 1 << 40
    out = tmp_path / "out.safetensors"
    with hostile(
        {"/v1/plan": {"route": "base", "base": 0, "deltas": []}, "/v1/versions": listing(huge_base(size))}
    ) as url:
        p = sparrowrl("fetch", url, "--version", 0, "-o", out, env={"SPARROWRL_TOKEN": TOKEN})
    refused(p, *words)
    assert not out.exists()


@pytest.mark.timeout(120)
def test_pieces_at_negative_offsets_are_refused(tmp_path, rng):
    save_file({"w": random_tensor(rng, "F32", (8,))}, tmp_path / "base.safetensors")
    out = tmp_path / "out.safetensors"
    with hostile(
        {
            "/v1/plan": {"route": "chain", "base": None, "deltas": [1]},
            "/v1/versions": listing(None),
            "/v1/versions/1/pieces": {
                "pieces": [[-8, 8, "a" * 64, True, ""]],
                "complete": True,
                "bytes": 8,
                "epoch": "file",
            },
        }
    ) as url:
        p = sparrowrl(
            "fetch",
            url,
            "--version",
            1,
            "--base",
            tmp_path / "base.safetensors",
            "--base-version",
            0,
            "-o",
            out,
            env={"SPARROWRL_TOKEN": TOKEN},
        )
    refused(p, "/v1/versions/1/pieces: pieces.0.0", "greater than or equal to 0")
    assert not out.exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "plan, words",
    [
        (
            {"route": "base", "base": 1, "deltas": []},
            ["the plan names base v1, which the version listing does not hold"],
        ),
        (
            {"route": "base", "base": 7, "deltas": []},
            ["route 'base' (base 7, 0 deltas) does not lead from nothing to v1"],
        ),
        (
            {"route": "base", "base": 0, "deltas": [2]},
            ["route 'base' (base 0, 1 deltas) does not lead from nothing to v1"],
        ),
        ({"route": "chain", "base": None, "deltas": [1]}, ["route 'chain' to v1 for a client that holds nothing"]),
        ({"route": "teleport", "base": None, "deltas": []}, ["/v1/plan: route: Input should be"]),
        (
            {"route": "chain", "base": None, "deltas": [-1]},
            ["/v1/plan: deltas.0: Input should be greater than or equal to 0"],
        ),
    ],
)
def test_a_plan_that_does_not_fit_the_listing_is_refused(tmp_path, plan, words):
    out = tmp_path / "out.safetensors"
    with hostile({"/v1/plan": plan, "/v1/versions": listing(huge_base(100))}) as url:
        p = sparrowrl("fetch", url, "--version", 1, "-o", out, env={"SPARROWRL_TOKEN": TOKEN})
    refused(p, *words)
    assert not out.exists()


@pytest.mark.timeout(240)
def test_a_delta_whose_pieces_never_end_is_refused_before_memory_runs_out(tmp_path, rng):
    """Each listing names 64 more verified MiB, and the delta is never complete: the client
    stops at the memory it has, with one line, not a MemoryError (its child has 2 GiB to spare)."""
    mib = 1 << 20
    zeros = hashlib.sha256(bytes(mib)).hexdigest()

    def pieces(request):  # signed with the job's key: a trainer's delta is bounded too
        after, sign = int(request.query.get("after", 0)), Signer(TOKEN).sign
        return web.json_response(
            {
                "pieces": [
                    [o, mib, zeros, False, sign(piece_statement(1, o, mib, zeros, False))]
                    for o in ((after + i) * mib for i in range(64))
                ],
                "complete": False,
                "bytes": None,
                "epoch": "file",
            }
        )

    def delta(request):
        r = request.http_range
        return web.Response(status=206, body=bytes(r.stop - r.start))

    save_file({"w": random_tensor(rng, "F32", (8,))}, tmp_path / "base.safetensors")
    out = tmp_path / "out.safetensors"
    with hostile(
        {
            "/v1/plan": {"route": "chain", "base": None, "deltas": [1]},
            "/v1/versions": listing(None),
            "/v1/versions/1/pieces": pieces,
            "/v1/versions/1/delta": delta,
        }
    ) as url:
        p = sparrowrl(
            "fetch",
            url,
            "--version",
            1,
            "--base",
            tmp_path / "base.safetensors",
            "--base-version",
            0,
            "-o",
            out,
            env={"SPARROWRL_TOKEN": TOKEN},
            timeout=200,
        )
    refused(p, "delta v1: the server's pieces take more than the memory free here")
    assert not out.exists()
