#!/usr/bin/env python3
"""Transfer benchmark: each figure beside its reference, measured in the same run.

  loopback   8 concurrent clients pulling a base from one server   vs  8 concurrent curl
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
        b[idx] = torch.from_numpy(rng.integers(-2**15, 2**15, len(idx), dtype=np.int16))  # transfer-sized
        states.append({"w": nxt})
    return states


async def _fetch(url: str, what: str, version: int, streams: int, ports: list[int], wait_for: int | None) -> dict:
    from sparrowrl.transport.client import Client

    async with Client(url, token=TOKEN, streams=streams, local_ports=ports or None, backoff=0.05,
                      attempts=40) as c:
        if wait_for is not None:  # long-poll until the version is being published here, then fetch
            while True:
                listing = await c.versions(after=wait_for - 1, wait=30)
                if listing["newest"] >= wait_for or (what == "cut" and wait_for in listing["producing"]):
                    break
        t0 = time.time()
        if what == "base":
            listing = await c.versions()
            await c.base(version, listing)
        else:
            await c.delta(version)
        return {"t0": t0, "t1": time.time(), "bytes": c.stats.bytes, "retries": c.stats.retries,
                "requests": c.stats.requests, "download_s": c.stats.seconds}


def fetch_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("what", choices=["base", "delta", "cut"])
    ap.add_argument("version", type=int)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--ports", type=int, nargs="*", default=[])
    ap.add_argument("--wait-for", type=int)
    a = ap.parse_args(argv)
    print("ready", flush=True)
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


def loopback(store: Path, base_bytes: int) -> dict:
    from sparrowrl.transport.client import Client

    env = dict(os.environ, SPARROWRL_TOKEN=TOKEN)
    server = start([EXE, "serve", str(store), "--port", "8470"], env)
    try:
        wait_port("127.0.0.1", 8470)

        async def clients() -> float:
            cs = [Client("http://127.0.0.1:8470", token=TOKEN, streams=2) for _ in range(8)]
            for c in cs:
                await c.__aenter__()
            listing = await cs[0].versions()
            t0 = time.perf_counter()
            await asyncio.gather(*(c.download("/v1/versions/0/base", base_bytes, _pieces(listing)) for c in cs))
            dt = time.perf_counter() - t0
            for c in cs:
                await c.__aexit__(None, None, None)
            return dt

        dt = asyncio.run(clients())
        t0 = time.perf_counter()
        curls = [start(["curl", "-sf", "-o", "/dev/null", "-H", f"Authorization: Bearer {TOKEN}",
                        "http://127.0.0.1:8470/v1/versions/0/base"]) for _ in range(8)]
        assert all(c.wait() == 0 for c in curls)
        dt_curl = time.perf_counter() - t0
    finally:
        server.kill()
    total = 8 * base_bytes
    return {"clients": 8, "bytes_each": base_bytes, "sparrowrl_MBps": total / dt / 1e6,
            "curl_MBps": total / dt_curl / 1e6, "ratio": dt_curl / dt}


def _pieces(listing: dict):
    from sparrowrl.transport.client import Piece

    b = next(v for v in listing["versions"] if v["version"] == 0)["base"]
    return [Piece(i * b["part_bytes"], min(b["part_bytes"], b["bytes"] - i * b["part_bytes"]), h)
            for i, h in enumerate(b["parts"])]


def wan_benchmarks(store_dir: Path, states: list, link: float, workers: int, repeat: int) -> dict:
    from wan import ORIGIN, Wan, flow_port

    from sparrowrl.delta.frame import TensorSpec
    from sparrowrl.store import Store

    me, wanpy = str(Path(__file__).resolve()), str(HERE / "wan" / "wan.py")
    env = dict(os.environ, SPARROWRL_TOKEN=TOKEN, PYTHONUNBUFFERED="1")
    out: dict = {"link_mbit": link, "per_flow_mbit": link / 4}
    with Wan(regions=["us", "eu"], link_mbit=link, per_flow_mbit=link / 4) as wan:
        origin = f"http://{wan.addr(ORIGIN)}:8470"
        procs = [wan.popen(ORIGIN, [EXE, "serve", str(store_dir), "--host", "0.0.0.0", "--port", "8470"], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        raw = wan.popen(ORIGIN, [sys.executable, wanpy, "_serve", "8000"], stdout=subprocess.PIPE, text=True)
        raw.stdout.readline()
        wait_port(wan.addr(ORIGIN), 8470, run=lambda a, **k: wan.run("us", a, **k))

        def fetch(ns: str, url: str, what: str, v: int, streams: int, ports: list[int], wait_for=None):
            cmd = [sys.executable, me, "_fetch", url, what, str(v), "--streams", str(streams),
                   "--ports", *map(str, ports)] + ([] if wait_for is None else ["--wait-for", str(wait_for)])
            p = wan.popen(ns, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
            return p

        def result(p) -> dict:
            line = p.stdout.readline()
            if p.wait() != 0 or not line:
                raise RuntimeError(p.stderr.read())
            return json.loads(line)

        # streams: goodput of one base download with 1/2/4/8 streams, raw TCP 4 streams as reference
        res = wan.run("us", [sys.executable, wanpy, "_xfer", wan.addr(ORIGIN), "8000", "GET", str(24_000_000),
                             *[str(flow_port(i)) for i in range(4)]], capture_output=True, text=True, timeout=120)
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
            out["streams"][n] = {"mbit": mbit, "of_link": mbit / link, "of_raw_tcp": mbit / out["raw_tcp_4_streams_mbit"]}
            print(f"  {n} streams: {mbit:.1f} Mbit/s ({mbit / link:.0%} of the link)", file=sys.stderr)

        # fan-out: one new delta to `workers` workers in each region, direct vs via relays
        store = Store(store_dir)
        k = next(rounds)  # the relays' upstream streams get flow classes 12..15 of their region's link
        relay_logs = {r: store_dir.parent / f"relay-{r}.log" for r in ("us", "eu")}
        relays = [wan.popen(r, [EXE, "relay", "--upstream", origin, "--port", "8471", "--local-ports",
                                ",".join(str(flow_port(16 * k + 12 + i)) for i in range(4))], env=env,
                            stdout=open(relay_logs[r], "w"), stderr=subprocess.STDOUT) for r in ("us", "eu")]
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
                    res = wan.run(r, ["curl", "-sf", "-H", f"Authorization: Bearer {TOKEN}",
                                      "http://127.0.0.1:8471/v1/versions"], capture_output=True, text=True)
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
            ps = [fetch(r, url_of(r), how, v, 4, [flow_port(16 * k + 4 * w + s) for s in range(4)] if via_wan else [],
                        wait_for=v)
                  for r in regions for w in range(n)]
            time.sleep(1.0)  # all workers are long-polling
            t0 = time.time()
            with store.publish([TensorSpec.of("w", states[v]["w"])]) as w:  # as the trainer does: old state in memory
                w.add([("w", states[v - 1]["w"], states[v]["w"])])
            return max(result(p)["t1"] for p in ps) - t0

        # each figure `repeat` times, interleaved, so that a noisy moment of this shared VM hits
        # all of them alike; the ratios use medians
        runs: dict[str, list[float]] = {"fanout_direct_s": [], "fanout_relays_s": [], "single_transfer_s": [],
                                        "single_store_and_forward_s": []}
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
                fan_out(lambda r: origin, v := v + 1, regions=("us",), n=1, how="delta"))
        for key, xs in runs.items():
            out[key] = statistics.median(xs)
            out[key.removesuffix("_s") + "_runs_s"] = xs
        out["delta_bytes"] = store.versions[2].delta_bytes
        out["relays_vs_single"] = out["fanout_relays_s"] / out["single_transfer_s"]
        out["direct_vs_single"] = out["fanout_direct_s"] / out["single_transfer_s"]
        out["relays_vs_single_runs"] = [r / s for r, s in zip(runs["fanout_relays_s"], runs["single_transfer_s"])]
        print(f"  relays/single per round: {', '.join(f'{x:.2f}' for x in out['relays_vs_single_runs'])}",
              file=sys.stderr)
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
    ap.add_argument("--workers", type=int, default=3, help="workers per region")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the fan-out figures (medians reported)")
    a = ap.parse_args()
    if not 1 <= a.repeat <= 3:
        ap.error("--repeat: 1 to 3 (the emulated WAN has 15 rounds of fresh flow-classed ports)")
    from sparrowrl.store import Store

    with tempfile.TemporaryDirectory(prefix="sprl-bench-") as tmp:
        states = make_states(a.elements, 4 * a.repeat, 0.05)
        store = Store.init(Path(tmp) / "store", states[0], base_every=1000)
        os.chmod(tmp, 0o755)
        result = {"elements": a.elements, "base_bytes": store.versions[0].base_bytes}
        print("loopback: 8 clients ...", file=sys.stderr)
        result["loopback"] = loopback(store.path, store.versions[0].base_bytes)
        if os.geteuid() == 0:
            print("emulated WAN ...", file=sys.stderr)
            result["wan"] = wan_benchmarks(store.path, states, a.link_mbit, a.workers, a.repeat)
    print(json.dumps(result, indent=1))
    a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
