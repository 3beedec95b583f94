#!/usr/bin/env python3
"""Transfer benchmark: each figure beside its reference, measured in the same run.

  loopback   a 1 GiB base pulled from one server by one client process (4 streams), then by 8
             at once, every part verified                          vs  1 and 8 curl processes,
                                                                       into /dev/null and into memory
  decode     a chain of deltas and a base pulled by one process     vs  decode + verified apply of
                                                                       the same bytes
  signatures the trainer's Ed25519 signing and a worker's check of    vs  the same deltas' pull, with
             each piece of those deltas                                the check and without
  commit     the additive state hash's update per changed element    vs  a forgery-resistant LtHash16's
                                                                       (2 KiB of SHAKE256 per term)
  checksums  sha256 and BLAKE3 on one core                          vs  memcpy
  streams    goodput of 1/2/4/8 streams over an emulated WAN link whose per-flow cap is a
             quarter of the link (hack/wan; needs root)              vs  raw TCP, 4 streams
  fan-out    one delta to 3 workers in each of 2 regions, direct from the origin vs through one
             relay per region, timed from the start of publishing, all cut-through (the relays
             are paused, SIGSTOP, outside the relayed rounds: they would share the links)
                                                                    vs  one worker alone, direct
  latency    one worker alone, direct: cut-through vs store-and-forward (from publish start)

Prints a table and writes JSON (default docs/bench_transfer.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "wan"))
TOKEN = "bench-token"
EXE = str(Path(sys.executable).parent / "sparrowrl")


def make_states(n: int, versions: int, density: float) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=g).bfloat16()
    states = [{"w": w}]
    rng = np.random.default_rng(0)
    for _ in range(versions):
        nxt = states[-1]["w"].clone()
        b = nxt.view(torch.int16)
        idx = torch.from_numpy(rng.choice(n, int(n * density), replace=False))
        b[idx] = torch.from_numpy(rng.integers(-(2**15), 2**15, len(idx), dtype=np.int16))  # transfer-sized
        states.append({"w": nxt})
    return states


async def _fetch(url: str, what: str, version: int, streams: int, ports: list[int], wait_for: int | None) -> dict:
    from sparrowrl.transport.client import Client

    async with Client(url, token=TOKEN, streams=streams, local_ports=ports or None, backoff=0.05, attempts=40) as c:
        if wait_for is not None:  # long-poll until the version is being published here, then fetch
            while True:
                listing = await c.versions(after=wait_for - 1, wait=30)
                if listing["newest"] >= wait_for or (what == "cut" and wait_for in listing["producing"]):
                    break
        t0 = time.time()
        if what == "base":
            listing = await c.versions()
            await c.base(version, listing)
        elif what == "parts":  # verified pieces into one buffer: the pull alone
            listing = await c.versions()
            await c.download(f"/v1/versions/{version}/base", *_base_pieces(listing, version))
        else:
            await c.delta(version)
        return {
            "t0": t0,
            "t1": time.time(),
            "bytes": c.stats.bytes,
            "retries": c.stats.retries,
            "requests": c.stats.requests,
            "download_s": c.stats.seconds,
        }


def fetch_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("what", choices=["base", "parts", "delta", "cut"])
    ap.add_argument("version", type=int)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--ports", type=int, nargs="*", default=[])
    ap.add_argument("--wait-for", type=int)
    a = ap.parse_args(argv)
    print("ready", flush=True)
    if a.wait_for is None:  # started with others (loopback): all begin together
        sys.stdin.readline()
    print(json.dumps(asyncio.run(_fetch(a.url, a.what, a.version, a.streams, a.ports, a.wait_for))), flush=True)


def start(cmd: list[str], env: dict | None = None, popen=subprocess.Popen) -> subprocess.Popen:
    return popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_port(host: str, port: int, run=None, timeout: float = 60) -> None:
    probe = [sys.executable, "-c", f"import socket; socket.create_connection(('{host}', {port}), 1).close()"]
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (run or subprocess.run)(probe, capture_output=True).returncode == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on {host}:{port}")


def _processes(cmds: list[list[str]], env: dict) -> list[dict]:
    """Run fetch processes that start together: each imports, says ready, and waits for go."""
    ps = [
        subprocess.Popen(c, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c in cmds
    ]
    for p in ps:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    for p in ps:
        p.stdin.write("go\n")
        p.stdin.flush()
    out = []
    for p in ps:
        line = p.stdout.readline()
        if p.wait() != 0 or not line:
            raise RuntimeError(p.stderr.read())
        out.append(json.loads(line))
    return out


def _curls(url: str, n: int, keep: bool = False) -> float:
    """Seconds for n curl processes to fetch `url` together, into /dev/null, or with `keep` into
    memory (files in /dev/shm), as a client holding what it pulled must."""
    with tempfile.TemporaryDirectory(prefix="sprl-curl-", dir="/dev/shm" if keep else None) as d:
        outs = [f"{d}/{i}" if keep else "/dev/null" for i in range(n)]
        t0 = time.perf_counter()
        curls = [start(["curl", "-sf", "-o", o, "-H", f"Authorization: Bearer {TOKEN}", url]) for o in outs]
        assert all(c.wait() == 0 for c in curls)
        return time.perf_counter() - t0


def loopback(store: Path, base_bytes: int, rounds: int) -> dict:
    """A base pulled from one server over loopback, beside curl in the same rounds: one process
    with 4 streams, then 8 processes at once. Medians of `rounds` interleaved rounds."""
    env = dict(os.environ, SPARROWRL_TOKEN=TOKEN)
    url = "http://127.0.0.1:8470"
    base = f"{url}/v1/versions/0/base"
    server = start([EXE, "serve", str(store), "--port", "8470"], env)
    fetch = [sys.executable, str(Path(__file__).resolve()), "_fetch", url]
    runs: dict[str, list[float]] = {
        k: []
        for k in (
            "one_pull",
            "one_base",
            "one_curl",
            "one_curl_memory",
            "eight_pull",
            "eight_curl",
            "eight_curl_memory",
        )
    }
    try:
        wait_port("127.0.0.1", 8470)
        for i in range(rounds):
            print(f"  loopback round {i + 1}/{rounds}", file=sys.stderr)
            r = _processes([fetch + ["base", "0", "--streams", "4"]], env)[0]
            runs["one_pull"].append(r["bytes"] / r["download_s"] / 1e6)  # verified parts in place
            runs["one_base"].append(r["bytes"] / (r["t1"] - r["t0"]) / 1e6)  # and the tensors, hashed
            runs["one_curl"].append(base_bytes / _curls(base, 1) / 1e6)
            runs["one_curl_memory"].append(base_bytes / _curls(base, 1, keep=True) / 1e6)
            rs = _processes([fetch + ["parts", "0", "--streams", "4"]] * 8, env)
            runs["eight_pull"].append(
                sum(r["bytes"] for r in rs) / (max(r["t1"] for r in rs) - min(r["t0"] for r in rs)) / 1e6
            )
            runs["eight_curl"].append(8 * base_bytes / _curls(base, 8) / 1e6)
            runs["eight_curl_memory"].append(8 * base_bytes / _curls(base, 8, keep=True) / 1e6)
    finally:
        server.kill()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "base_bytes": base_bytes,
        "rounds": runs,
        "one_process": {
            "streams": 4,
            "pull_MBps": med["one_pull"],
            "base_MBps": med["one_base"],
            "curl_MBps": med["one_curl"],
            "pull_of_curl": med["one_pull"] / med["one_curl"],
            "curl_into_memory_MBps": med["one_curl_memory"],
            "pull_of_curl_into_memory": med["one_pull"] / med["one_curl_memory"],
        },
        "eight_processes": {
            "streams": 4,
            "pull_MBps": med["eight_pull"],
            "curl_MBps": med["eight_curl"],
            "pull_of_curl": med["eight_pull"] / med["eight_curl"],
            "curl_into_memory_MBps": med["eight_curl_memory"],
            "pull_of_curl_into_memory": med["eight_pull"] / med["eight_curl_memory"],
        },
    }


def hashes(size: int = 256 << 20, rounds: int = 3) -> dict:
    """A piece checksum's cost on one core, beside memcpy: sha256 (what pieces carry) and BLAKE3
    (shardcast's; `pip install -e '.[bench]'`), best of `rounds`."""
    import hashlib

    data, out = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes(), bytearray(size)
    ways = {"memcpy": lambda: out.__setitem__(slice(None), data), "sha256": lambda: hashlib.sha256(data).digest()}
    try:
        import blake3

        ways["blake3"] = lambda: blake3.blake3(data).digest()
        ways["blake3_all_cores"] = lambda: blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest()
    except ImportError:
        print("  (blake3 not installed: pip install -e '.[bench]')", file=sys.stderr)
    best = {}
    for _ in range(rounds):
        for name, f in ways.items():
            t0 = time.perf_counter()
            f()
            best[name] = min(best.get(name, 1e9), time.perf_counter() - t0)
    return {f"{name}_GBps": size / s / 1e9 for name, s in best.items()}


def warm_up_apply() -> None:
    """One small delta applied, so that timed applies do not include loading numba's kernels."""
    import io

    from sparrowrl.delta import DeltaFile, apply_delta, state_hash, write_delta

    old = {"w": torch.randn(1 << 20).bfloat16()}
    new = {"w": old["w"].clone()}
    new["w"].view(torch.int16)[::100] += 1
    buf = io.BytesIO()
    write_delta(buf, old, new, base_version=0, base_hash=state_hash(old), target_version=1)
    apply_delta(DeltaFile(buf.getvalue()), old)


def decode_vs_pull(elements: int, rounds: int) -> dict:
    """Whether the CPU keeps up with the pull: a chain of deltas (1% of elements changed by one
    ULP each) pulled over loopback by one process with 4 streams, beside
    decode + verified apply of the same deltas into the state; a base's pull beside its load +
    full state hash."""
    from sparrowrl.delta import apply_delta, state_hash
    from sparrowrl.delta.tensors import TensorSpec
    from sparrowrl.store.checkpoint_io import tensors_in
    from sparrowrl.store.store import Store
    from sparrowrl.transport.client import Client

    gen = torch.Generator().manual_seed(1)
    states = [{"w": (torch.randn(elements, generator=gen) * 0.02).bfloat16()}]
    for _ in range(rounds):  # 1% of elements move by one ULP, as small RL updates do
        w = states[-1]["w"].clone()
        moved = torch.rand(elements, generator=gen) < 0.01
        w.view(torch.int16)[moved] += torch.randint(0, 2, (int(moved.sum()),), generator=gen, dtype=torch.int16) * 2 - 1
        states.append({"w": w})
    env = dict(os.environ, SPARROWRL_TOKEN=TOKEN)
    with tempfile.TemporaryDirectory(prefix="sprl-decode-") as tmp:
        store = Store.init(Path(tmp) / "store", states[0], base_every=1000)
        for v in range(1, rounds + 1):
            with store.publish([TensorSpec.of("w", states[v]["w"])]) as writer:
                writer.add([("w", states[v - 1]["w"], states[v]["w"])])
        server = start([EXE, "serve", str(store.path), "--port", "8472"], env)
        try:
            wait_port("127.0.0.1", 8472)

            async def run() -> dict:
                async with Client("http://127.0.0.1:8472", token=TOKEN, streams=4) as c:
                    listing = await c.versions()
                    await c.base(0, listing)
                    base_pull_s = c.stats.seconds
                    raw = bytearray((store.path / "bases" / store.versions[0].base).read_bytes())
                    t0 = time.perf_counter()
                    state_hash(tensors_in(raw))
                    load_s = time.perf_counter() - t0
                    warm_up_apply()  # numba loads its compiled kernels on first use: once per process
                    state = {"w": states[0]["w"].clone()}
                    h, pull_s, apply_s, nbytes, changed = store.versions[0].state_hash, 0.0, 0.0, 0, 0
                    for v in range(1, rounds + 1):
                        before = c.stats.seconds
                        d = await c.delta(v)
                        pull_s += c.stats.seconds - before
                        t0 = time.perf_counter()
                        h = apply_delta(d, state, base_hash=h)
                        apply_s += time.perf_counter() - t0
                        nbytes, changed = nbytes + len(d.data), changed + store.versions[v].changed
                    assert h == store.versions[rounds].state_hash
                    touch_s = _touch_floor(states)
                    signed = await _signature_cost(c, rounds)
                    return {
                        "base_bytes": len(raw),
                        "base_pull_MBps": len(raw) / base_pull_s / 1e6,
                        "base_load_hash_MBps": len(raw) / load_s / 1e6,
                        "deltas": rounds,
                        "delta_bytes": nbytes,
                        "changed": changed,
                        "density": changed / (rounds * elements),
                        "delta_pull_MBps": nbytes / pull_s / 1e6,
                        "delta_apply_MBps": nbytes / apply_s / 1e6,
                        "apply_of_pull": pull_s / apply_s,
                        "touch_only_MBps": nbytes / touch_s / 1e6,
                        "apply_of_touch": touch_s / apply_s,
                        "signatures": signed,
                        "commit_check": _commit_check_cost(),
                    }

            return asyncio.run(run())
        finally:
            server.kill()


async def _signature_cost(c, deltas: int, rounds: int = 5) -> dict:
    """What vouching for versions costs a delta's transfer: each piece signed once by the trainer
    and checked by each worker (medians of 500 in this run, on a real piece), beside the pull of
    the same deltas; and the pull itself with the check and without, alternating, best of `rounds`."""
    pieces = [p for v in range(1, deltas + 1) for p in (await c.json(f"/v1/versions/{v}/pieces"))["pieces"]]
    sign_s, verify_s = _sign_verify_s(pieces[1][:4])
    pulls: dict[str, list[float]] = {"checked": [], "unchecked": []}
    trusted = c.trust
    try:
        for _ in range(rounds):
            for way in pulls:
                c.trust = trusted if way == "checked" else None
                before = c.stats.seconds
                for v in range(1, deltas + 1):
                    await c.delta(v)
                pulls[way].append(c.stats.seconds - before)
    finally:
        c.trust = trusted
    cost = len(pieces) * (sign_s + verify_s)
    pull_s = min(pulls["checked"])
    return {
        "pieces": len(pieces),
        "piece_bytes_mean": sum(p[1] for p in pieces) / len(pieces),
        "sign_us": sign_s * 1e6,
        "verify_us": verify_s * 1e6,
        "pull_checked_s": pull_s,
        "pull_unchecked_s": min(pulls["unchecked"]),
        "cost_of_pull": cost / pull_s,
        "checked_over_unchecked": pull_s / min(pulls["unchecked"]) - 1,
    }


def _commit_check_cost(n: int = 1 << 20, lt: int = 20_000) -> dict:
    """ns per changed element of the commit check: the additive hash's update (what apply does),
    beside LtHash16's (each term 1024 u16 lanes from SHAKE256 of the element's key and value,
    the old term subtracted and the new added); LtHash timed on `lt` elements."""
    import hashlib
    import struct

    from sparrowrl.delta.statehash import TensorKey

    rng = np.random.default_rng(0)
    key = TensorKey("w", "BF16", (1 << 26,), 2)
    pos = np.sort(rng.choice(1 << 26, n, replace=False)).astype(np.int64)
    old, new = (rng.integers(0, 1 << 16, n, dtype=np.uint16) for _ in range(2))
    key.change(pos[:10], old[:10], new[:10])  # numba's kernel loaded
    t0 = time.perf_counter()
    key.change(pos, old, new)
    additive = (time.perf_counter() - t0) / n
    acc = np.zeros(1024, np.uint16)
    t0 = time.perf_counter()
    for i, a, b in zip(pos[:lt].tolist(), old[:lt].tolist(), new[:lt].tolist()):
        acc -= np.frombuffer(hashlib.shake_256(struct.pack("<QQ", i, a)).digest(2048), np.uint16)
        acc += np.frombuffer(hashlib.shake_256(struct.pack("<QQ", i, b)).digest(2048), np.uint16)
    lthash = (time.perf_counter() - t0) / lt
    t0 = time.perf_counter()
    hashlib.shake_256(b"x").digest(64 << 20)
    floor = 4096 / (64 << 20) * (time.perf_counter() - t0)  # its 4 KiB of SHAKE output alone, no Python loop
    return {
        "additive_ns": additive * 1e9,
        "lthash16_ns": lthash * 1e9,
        "lthash16_shake_floor_ns": floor * 1e9,
        "lthash_over_additive": lthash / additive,
        "lthash_floor_over_additive": floor / additive,
    }


def _sign_verify_s(piece: list) -> tuple[float, float]:
    """Seconds to sign one piece (the trainer, once) and to check it (each worker): medians of 500."""
    from sparrowrl.auth.signing import Signer, piece_statement

    signer, statement = Signer(TOKEN), piece_statement(1, *piece)
    sign, verify = [], []
    for _ in range(500):
        t0 = time.perf_counter()
        sig = signer.sign(statement)
        t1 = time.perf_counter()
        assert signer.verifier.ok(statement, sig)
        sign.append(t1 - t0)
        verify.append(time.perf_counter() - t1)
    return statistics.median(sign), statistics.median(verify)


def _touch_floor(states: list[dict[str, torch.Tensor]]) -> float:
    """Seconds to read and assign, in place, the elements that the chain changes, with their
    positions and new patterns already known (nothing decoded, checked or hashed), with the
    same gather and scatter passes as apply: the floor that memory sets for any in-place apply
    on this machine."""
    from sparrowrl.delta import kernels

    flat = states[0]["w"].clone().view(torch.int16).numpy().view(np.uint16)  # as apply sees it
    kernels.scatter(flat, 0, np.zeros(1, np.int64), kernels.gather(flat, 0, np.zeros(1, np.int64)))  # load
    seconds = 0.0
    for old, new in zip(states, states[1:]):
        o, n = (s["w"].view(torch.int16).numpy().view(np.uint16) for s in (old, new))
        positions = np.flatnonzero(o != n).astype(np.int64)
        values = n[positions]
        t0 = time.perf_counter()
        kernels.gather(flat, 0, positions)
        kernels.scatter(flat, 0, positions, values)
        seconds += time.perf_counter() - t0
    return seconds


def _base_pieces(listing: dict, version: int) -> tuple[int, list]:
    """The size and the parts of `version`'s base, as the version listing gives them."""
    from sparrowrl.transport.streams import Piece

    b = next(v for v in listing["versions"] if v["version"] == version)["base"]
    return b["bytes"], [
        Piece(i * b["part_bytes"], min(b["part_bytes"], b["bytes"] - i * b["part_bytes"]), h)
        for i, h in enumerate(b["parts"])
    ]


def wan_benchmarks(store_dir: Path, states: list, link: float, workers: int, repeat: int) -> dict:
    from wan import ORIGIN, Wan, flow_port

    from sparrowrl.delta.tensors import TensorSpec
    from sparrowrl.store.store import Store

    me, wanpy = str(Path(__file__).resolve()), str(HERE / "wan" / "wan.py")
    env = dict(os.environ, SPARROWRL_TOKEN=TOKEN, PYTHONUNBUFFERED="1")
    out: dict = {"link_mbit": link, "per_flow_mbit": link / 4}
    with Wan(regions=["us", "eu"], link_mbit=link, per_flow_mbit=link / 4) as wan:
        origin = f"http://{wan.addr(ORIGIN)}:8470"
        procs = [
            wan.popen(
                ORIGIN,
                [EXE, "serve", str(store_dir), "--host", "0.0.0.0", "--port", "8470"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        ]
        raw = wan.popen(ORIGIN, [sys.executable, wanpy, "_serve", "8000"], stdout=subprocess.PIPE, text=True)
        raw.stdout.readline()
        wait_port(wan.addr(ORIGIN), 8470, run=lambda a, **k: wan.run("us", a, **k))

        def fetch(ns: str, url: str, what: str, v: int, streams: int, ports: list[int], wait_for=None):
            cmd = [
                sys.executable,
                me,
                "_fetch",
                url,
                what,
                str(v),
                "--streams",
                str(streams),
                "--ports",
                *map(str, ports),
            ] + ([] if wait_for is None else ["--wait-for", str(wait_for)])
            p = wan.popen(ns, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
            return p

        def result(p) -> dict:
            line = p.stdout.readline()
            if p.wait() != 0 or not line:
                raise RuntimeError(p.stderr.read())
            return json.loads(line)

        # streams: goodput of one base download with 1/2/4/8 streams, raw TCP 4 streams as reference
        res = wan.run(
            "us",
            [
                sys.executable,
                wanpy,
                "_xfer",
                wan.addr(ORIGIN),
                "8000",
                "GET",
                str(24_000_000),
                *[str(flow_port(i)) for i in range(4)],
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        out["raw_tcp_4_streams_mbit"] = json.loads(res.stdout)["total_mbit"]
        out["streams"] = {}
        # fixed client ports stay in TIME_WAIT after a run: each run takes fresh ones of the same
        # classes (class = port % 16), round k using flow_port(16 * k + i)
        rounds = iter(range(1, 16))
        for n in (1, 2, 4, 8):
            k = next(rounds)
            r = result(fetch("us", origin, "base", 0, n, [flow_port(16 * k + i) for i in range(n)]))
            mbit = r["bytes"] * 8 / r["download_s"] / 1e6  # the transfer itself: not loading or hashing
            print(f"  ({r['requests']} requests, {r['retries']} retries)", file=sys.stderr)
            out["streams"][n] = {
                "mbit": mbit,
                "of_link": mbit / link,
                "of_raw_tcp": mbit / out["raw_tcp_4_streams_mbit"],
            }
            print(f"  {n} streams: {mbit:.1f} Mbit/s ({mbit / link:.0%} of the link)", file=sys.stderr)

        # fan-out: one new delta to `workers` workers in each region, direct vs via relays
        store = Store(store_dir)
        k = next(rounds)  # the relays' upstream streams get flow classes 12..15 of their region's link
        relay_logs = {r: store_dir.parent / f"relay-{r}.log" for r in ("us", "eu")}
        relays = [
            wan.popen(
                r,
                [
                    EXE,
                    "relay",
                    "--upstream",
                    origin,
                    "--port",
                    "8471",
                    "--local-ports",
                    ",".join(str(flow_port(16 * k + 12 + i)) for i in range(4)),
                ],
                env=env,
                stdout=open(relay_logs[r], "w"),
                stderr=subprocess.STDOUT,
            )
            for r in ("us", "eu")
        ]
        procs += relays
        for r in ("us", "eu"):
            wait_port("127.0.0.1", 8471, run=lambda a, r=r, **k: wan.run(r, a, **k))

        def relays_hold(v: int) -> None:
            """Resume the relays and wait until both hold version v (and so nothing older is
            still crossing the WAN when a round starts)."""
            for p in relays:
                os.killpg(p.pid, signal.SIGCONT)
            for r in ("us", "eu"):
                deadline = time.time() + 120
                while True:
                    res = wan.run(
                        r,
                        ["curl", "-sf", "-H", f"Authorization: Bearer {TOKEN}", "http://127.0.0.1:8471/v1/versions"],
                        capture_output=True,
                        text=True,
                    )
                    if res.returncode == 0 and json.loads(res.stdout)["newest"] >= v:
                        break
                    if time.time() > deadline:
                        raise RuntimeError(f"relay {r} did not reach v{v}")
                    time.sleep(0.2)

        def relays_stop() -> None:
            """Relays exist only in the relayed rounds: otherwise their own mirroring would share
            the links with the direct workers being timed."""
            for p in relays:
                os.killpg(p.pid, signal.SIGSTOP)

        def fan_out(url_of, v: int, regions=("us", "eu"), n=workers, how="cut", via_wan=True) -> float:
            """Seconds from the start of publishing version v until its last worker holds it;
            `cut`: every worker reads it cut-through, starting while the trainer still writes it;
            `delta`: store-and-forward, each worker starts once the version is stored.
            Workers that reach their server across the WAN get flow-classed ports; a relay's
            workers reach it inside their region, unshaped."""
            k = next(rounds) if via_wan else None
            ps = [
                fetch(
                    r,
                    url_of(r),
                    how,
                    v,
                    4,
                    [flow_port(16 * k + 4 * w + s) for s in range(4)] if via_wan else [],
                    wait_for=v,
                )
                for r in regions
                for w in range(n)
            ]
            time.sleep(1.0)  # all workers are long-polling
            t0 = time.time()
            with store.publish([TensorSpec.of("w", states[v]["w"])]) as w:  # as the trainer does: old state in memory
                w.add([("w", states[v - 1]["w"], states[v]["w"])])
            return max(result(p)["t1"] for p in ps) - t0

        # each figure `repeat` times, interleaved, so that a noisy moment of this shared VM hits
        # all of them alike; the ratios use medians
        runs: dict[str, list[float]] = {
            "fanout_direct_s": [],
            "fanout_relays_s": [],
            "single_transfer_s": [],
            "single_store_and_forward_s": [],
        }
        v = 0
        relays_hold(0)  # synced (no base crosses: none of their workers asks for one)
        relays_stop()
        for i in range(repeat):
            print(f"  fan-out round {i + 1}/{repeat}", file=sys.stderr)
            runs["fanout_direct_s"].append(fan_out(lambda r: origin, v := v + 1))
            relays_hold(v)
            runs["fanout_relays_s"].append(fan_out(lambda r: "http://127.0.0.1:8471", v := v + 1, via_wan=False))
            relays_stop()
            runs["single_transfer_s"].append(fan_out(lambda r: origin, v := v + 1, regions=("us",), n=1))
            runs["single_store_and_forward_s"].append(
                fan_out(lambda r: origin, v := v + 1, regions=("us",), n=1, how="delta")
            )
        for key, xs in runs.items():
            out[key] = statistics.median(xs)
            out[key.removesuffix("_s") + "_runs_s"] = xs
        out["delta_bytes"] = store.versions[2].delta_bytes
        d = store.delta(2)  # its pieces: the header, each chunk, the tail
        sign_s, verify_s = _sign_verify_s([0, len(d.data), "0" * 64, False])
        out["signature_of_single_transfer"] = (
            (len(d.manifest["chunks"]) + 2) * (sign_s + verify_s) / out["single_transfer_s"]
        )
        out["relays_vs_single"] = out["fanout_relays_s"] / out["single_transfer_s"]
        out["direct_vs_single"] = out["fanout_direct_s"] / out["single_transfer_s"]
        out["relays_vs_single_runs"] = [r / s for r, s in zip(runs["fanout_relays_s"], runs["single_transfer_s"])]
        print(
            f"  relays/single per round: {', '.join(f'{x:.2f}' for x in out['relays_vs_single_runs'])}", file=sys.stderr
        )
        for p in procs + [raw]:
            p.kill()
        out["relay_logs"] = {r: f.read_text().splitlines() for r, f in relay_logs.items()}
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_fetch":
        return fetch_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE.parent / "docs" / "bench_transfer.json")
    ap.add_argument("--link-mbit", type=float, default=200.0)
    ap.add_argument("--elements", type=int, default=64 << 20, help="bf16 elements in the model")
    ap.add_argument(
        "--loopback-elements",
        type=int,
        default=512 << 20,
        help="bf16 elements of the base pulled over loopback (default: 1 GiB)",
    )
    ap.add_argument(
        "--decode-elements",
        type=int,
        default=256 << 20,
        help="bf16 elements of the model whose deltas are pulled and applied",
    )
    ap.add_argument("--skip-wan", action="store_true", help="loopback figures only")
    ap.add_argument("--workers", type=int, default=3, help="workers per region")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the fan-out figures (medians reported)")
    a = ap.parse_args()
    if not 1 <= a.repeat <= 3:
        ap.error("--repeat: 1 to 3 (the emulated WAN has 15 rounds of fresh flow-classed ports)")
    from sparrowrl.store.store import Store

    with tempfile.TemporaryDirectory(prefix="sprl-bench-") as tmp:
        states = make_states(a.elements, 4 * a.repeat, 0.05)
        store = Store.init(Path(tmp) / "store", states[0], base_every=1000)
        os.chmod(tmp, 0o755)
        result = {"elements": a.elements, "base_bytes": store.versions[0].base_bytes}
        big = Store.init(Path(tmp) / "loopback", {"w": torch.randn(a.loopback_elements).bfloat16()}, base_every=1000)
        print("loopback: one process, then 8, beside curl ...", file=sys.stderr)
        result["loopback"] = loopback(big.path, big.versions[0].base_bytes, a.repeat)
        print("checksums beside memcpy ...", file=sys.stderr)
        result["hashes"] = hashes()
        print("decode + apply beside the pull ...", file=sys.stderr)
        result["decode"] = decode_vs_pull(a.decode_elements, 3)
        if os.geteuid() == 0 and not a.skip_wan:
            print("emulated WAN ...", file=sys.stderr)
            result["wan"] = wan_benchmarks(store.path, states, a.link_mbit, a.workers, a.repeat)
    print(json.dumps(result, indent=1))
    a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
