#!/usr/bin/env python3
"""One `sparrowrl relay` under fan-out: 1, 8, 32 and 128 concurrent pullers of the same delta,
then of the same base, each a full download through the relay's HTTP routes, beside one `curl`
of the same file from the same relay.

The store (a base v0 and a delta v1 of one bf16 tensor), the origin (`sparrowrl serve`) and the
relay (`sparrowrl relay`, with the relay token and trainer key that `sparrowrl credentials`
prints) are real processes; the
pullers run in this process on one asyncio loop. Each puller does what `transport/client.py`
does: it lists the versions (`/v1/versions`), the file's pieces (`.../pieces`, or
`.../base/pieces`), and fetches them over 4 streams, each a Range request of neighbouring
pieces. Pullers count bytes and do not hash them (the warm-up pull, which fills the relay's
cache, checks every piece): this measures the relay, not the load's CPU.

Reports per kind and puller count: aggregate goodput (all bytes over the time from the first
request to the last byte), per-puller p50/p99 seconds, and the relay's peak RSS and open file
descriptors, sampled from /proc every few milliseconds during the pulls.

    python hack/scale_relay.py [--quick] --out FILE.json

`run(quick, tmp)` is what hack/bench_scale.py calls.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import torch

EXE = str(Path(sys.executable).parent / "sparrowrl")
SECRET = "scale-relay-bench-secret"
STREAMS = 4  # per puller, as the client's default
PULLERS = (1, 8, 32, 128)
KINDS = ("delta", "base")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store(path: Path, elements: int, density: float) -> dict:
    """A store of base v0 (`elements` bf16) and delta v1 (`density` of them replaced by random
    bit patterns: a transfer-sized delta, as hack/bench_transfer.py makes)."""
    from sparrowrl.store.store import Store

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(elements, generator=gen) * 0.02).bfloat16()
    store = Store.init(path, {"w": w}, base_every=1000)
    new = w.clone()
    moved = torch.randperm(elements, generator=gen)[: int(elements * density)]
    new.view(torch.int16)[moved] = torch.randint(-(2**15), 2**15, (len(moved),), generator=gen, dtype=torch.int16)
    v = store.add({"w": new})
    return {"base_bytes": store.versions[0].base_bytes, "delta_bytes": v.delta_bytes}


def _start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:  # the child holds its own copy
        return subprocess.Popen(cmd, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT)


def _ready(url: str, proc: subprocess.Popen, log: Path, token: str, deadline_s: float = 60.0) -> None:
    """Until `url` answers 200 (the origin's listing; the relay's /readyz: synced)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[1]} exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(
                urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"}), timeout=1
            ) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {deadline_s:.0f} s: {log.read_text()[-2000:]}")


class Sampler:
    """The relay's resident memory and open descriptors, read from /proc every `every` seconds
    in a thread (the load's event loop is busy) while `with` lasts; peaks in bytes and counts."""

    def __init__(self, pid: int, every: float = 0.005):
        self.pid, self.every = pid, every
        self.peak_rss = self.peak_fds = 0
        self._stop = threading.Event()

    def rss(self) -> int:
        return _status(self.pid, "VmRSS")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def _run(self) -> None:
        while True:
            self.peak_rss = max(self.peak_rss, self.rss())
            self.peak_fds = max(self.peak_fds, self.fds())
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _status(pid: int, field: str) -> int:
    """A /proc/PID/status field in kB, as bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _runs(pieces: list[list], streams: int) -> list[tuple[int, int]]:
    """The Range requests of one download: runs of neighbouring pieces of about an equal share
    each, as the client's queue cuts them ((start, end) byte ranges)."""
    share = max(1, -(-sum(p[1] for p in pieces) // streams))
    runs, pieces = [], sorted(pieces)
    while pieces:
        start, end = pieces[0][0], pieces[0][0] + pieces[0][1]
        pieces.pop(0)
        while pieces and pieces[0][0] == end and end - start + pieces[0][1] <= share:
            end += pieces.pop(0)[1]
        runs.append((start, end))
    return runs


async def _listed(session: aiohttp.ClientSession, url: str, kind: str, v: int) -> tuple[dict, list[list]]:
    """The version listing and the file's complete piece list (long-polled while the relay
    still fetches it; a list in another order is read anew, as the client does)."""
    async with session.get(f"{url}/v1/versions") as r:
        r.raise_for_status()
        listing = await r.json()
    path = f"{url}/v1/versions/{v}/{'pieces' if kind == 'delta' else 'base/pieces'}"
    pieces, epoch = [], None
    while True:
        async with session.get(path, params={"after": len(pieces), "wait": 10}) as r:
            r.raise_for_status()
            t = await r.json()
        if t["epoch"] != epoch:
            epoch, fresh = t["epoch"], not pieces
            pieces = []
            if not fresh:
                continue
        pieces += t["pieces"]
        if t["complete"]:
            return listing, pieces


async def _pull(url: str, kind: str, v: int, token: str, check: bool = False) -> tuple[int, float]:
    """One full download of v's `kind` through the relay; (bytes, seconds). With `check`, each
    piece's sha256 (and a delta's whole-file sha256) is checked against the listing."""
    async with aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {token}"},
        connector=aiohttp.TCPConnector(limit=STREAMS),
        timeout=aiohttp.ClientTimeout(total=300),
    ) as session:
        t0 = time.perf_counter()
        listing, pieces = await _listed(session, url, kind, v)
        got = bytearray() if check else None
        parts: dict[int, bytes] = {}

        async def stream(start: int, end: int) -> int:
            n, buf = 0, bytearray()
            async with session.get(f"{url}/v1/versions/{v}/{kind}", headers={"Range": f"bytes={start}-{end - 1}"}) as r:
                if r.status != 206:
                    raise RuntimeError(f"{kind} v{v} bytes {start}-{end - 1}: HTTP {r.status} {await r.text()}")
                async for chunk in r.content.iter_any():
                    n += len(chunk)
                    if check:
                        buf += chunk
            if n != end - start:
                raise RuntimeError(f"{kind} v{v} bytes {start}-{end - 1}: {n} bytes came")
            if check:
                parts[start] = bytes(buf)
            return n

        n = sum(await asyncio.gather(*(stream(s, e) for s, e in _runs(pieces, STREAMS))))
        seconds = time.perf_counter() - t0
    entry = next(e for e in listing["versions"] if e["version"] == v)
    size = entry[kind]["bytes"]
    if n != size:
        raise RuntimeError(f"{kind} v{v}: {n} bytes pulled, the listing says {size}")
    if check:
        for s in sorted(parts):
            got += parts[s]
        for offset, length, sha, *_ in pieces:
            if hashlib.sha256(got[offset : offset + length]).hexdigest() != sha:
                raise RuntimeError(f"{kind} v{v}: piece at {offset} does not match its sha256")
        if kind == "delta" and hashlib.sha256(got).hexdigest() != entry["delta"]["sha256"]:
            raise RuntimeError(f"delta v{v}: its sha256 is not the listing's")
    return n, seconds


def _fan_out(url: str, kind: str, v: int, token: str, pullers: int, pid: int) -> dict:
    """`pullers` concurrent full downloads of the same file, with the relay sampled meanwhile."""

    async def go() -> tuple[list[tuple[int, float]], float]:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(_pull(url, kind, v, token) for _ in range(pullers)))
        return got, time.perf_counter() - t0

    relay0, load0 = _cpu(pid), time.process_time()
    with Sampler(pid) as s:
        got, wall = asyncio.run(go())
    relay_cpu, load_cpu = _cpu(pid) - relay0, time.process_time() - load0
    time.sleep(0.2)  # the relay's ends of the pullers' connections close
    fds_after = len(os.listdir(f"/proc/{pid}/fd"))
    total = sum(n for n, _ in got)
    return {
        "bytes": total,
        "wall_s": wall,
        "goodput_Bps": total / wall,
        "puller_s": [t for _, t in got],
        "relay_peak_rss_bytes": s.peak_rss,
        "relay_peak_fds": s.peak_fds,
        "relay_fds_after": fds_after,  # against the idle count: none kept per puller
        "relay_cpu_s": relay_cpu,  # beside wall_s: whether the relay (one core at most) is what bounds it
        "load_cpu_s": load_cpu,
    }


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _quantile(xs: list[float], q: float) -> float:
    """The q-quantile of sorted xs (nearest rank): p99 of 8 pullers is the slowest."""
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def _curl(url: str, kind: str, v: int, token: str) -> dict:
    """One plain GET of the file from the relay: curl into /dev/null where curl is installed,
    else one aiohttp GET (the result says which)."""
    target = f"{url}/v1/versions/{v}/{kind}"
    if shutil.which("curl"):
        out = subprocess.run(
            [
                "curl",
                "-sS",
                "-o",
                "/dev/null",
                "-H",
                f"Authorization: Bearer {token}",
                "-w",
                "%{size_download} %{time_total}",
                target,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        n, seconds = int(out[0]), float(out[1])
        tool = "curl"
    else:

        async def get() -> tuple[int, float]:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:
                t0, n = time.perf_counter(), 0
                async with session.get(target) as r:
                    r.raise_for_status()
                    async for chunk in r.content.iter_any():
                        n += len(chunk)
                return n, time.perf_counter() - t0

        (n, seconds), tool = asyncio.run(get()), "aiohttp (no curl here)"
    return {"tool": tool, "bytes": n, "seconds": seconds, "goodput_Bps": n / seconds}


def _row(kind: str, who: str, r: dict) -> str:
    """A line of the table: a fan-out's figures, or a reference's (one download: no sampling)."""
    if "seconds" in r:
        return f"{kind:<6}{who:>9}{r['goodput_Bps'] / 1e6:>12,.0f}{r['seconds']:>9.3f}{r['seconds']:>9.3f}"
    return (
        f"{kind:<6}{who:>9}{r['goodput_Bps'] / 1e6:>12,.0f}{r['p50_s']:>9.3f}{r['p99_s']:>9.3f}"
        f"{r['relay_peak_rss_bytes'] / 2**20:>10.0f}{r['relay_peak_fds']:>9}"
        f"{r['relay_cpu_s']:>8.2f}{r['load_cpu_s']:>8.2f}"
    )


def run(quick: bool, tmp: Path) -> dict:
    """Build the store, start origin and relay, warm the relay's cache, then measure each
    kind at each puller count (quick: a 16 MB base, one round; full: a 48 MB base, the median
    goodput of three rounds, with the p50/p99 of all their pullers). Prints a table as it goes."""
    from sparrowrl.auth.tokens import environment

    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    elements, rounds = (8 << 20, 1) if quick else (24 << 20, 3)
    t_build = time.perf_counter()
    sizes = _store(tmp / "store", elements, 0.05)
    print(
        f"scale_relay: store of a {sizes['base_bytes'] / 1e6:.1f} MB base and a {sizes['delta_bytes'] / 1e6:.2f} MB "
        f"delta in {time.perf_counter() - t_build:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    origin_port, relay_port = _free_port(), _free_port()
    origin_url, relay_url = f"http://127.0.0.1:{origin_port}", f"http://127.0.0.1:{relay_port}"
    relay_env = environment(SECRET, "relay", "bench")
    token = environment(SECRET, "worker", "bench")["SPARROWRL_TOKEN"]
    procs = []
    try:
        origin = _start(
            [EXE, "serve", str(tmp / "store"), "--port", str(origin_port)],
            {"SPARROWRL_TOKEN": SECRET},
            tmp / "origin.log",
        )
        procs.append(origin)
        _ready(f"{origin_url}/v1/versions", origin, tmp / "origin.log", token)
        relay = _start(
            [EXE, "relay", "--upstream", origin_url, "--port", str(relay_port), "--cache", str(tmp / "mirror")],
            relay_env,
            tmp / "relay.log",
        )
        procs.append(relay)
        _ready(f"{relay_url}/readyz", relay, tmp / "relay.log", token)
        out: dict = {
            "quick": quick,
            "rounds": rounds,
            "streams_per_puller": STREAMS,
            "base_bytes": sizes["base_bytes"],
            "delta_bytes": sizes["delta_bytes"],
            "relay_rss_idle_bytes": _status(relay.pid, "VmRSS"),
            "relay_fds_idle": len(os.listdir(f"/proc/{relay.pid}/fd")),
            "warmup_s": {},
            "reference": {},
            "fan_out": {},
        }
        print(
            f"{'kind':<6}{'pullers':>9}{'MB/s':>12}{'p50 s':>9}{'p99 s':>9}{'RSS MiB':>10}{'fds':>9}"
            f"{'relay s':>8}{'load s':>8}",
            file=sys.stderr,
            flush=True,
        )
        for kind in KINDS:
            v = 1 if kind == "delta" else 0
            # the warm-up: the base crosses from the origin now (the delta did at the relay's sync)
            out["warmup_s"][kind] = asyncio.run(_pull(relay_url, kind, v, token, check=True))[1]
            ref = out["reference"][kind] = _curl(relay_url, kind, v, token)
            print(_row(kind, ref["tool"], ref), file=sys.stderr, flush=True)
            out["fan_out"][kind] = {}
            for n in PULLERS:
                tries = [_fan_out(relay_url, kind, v, token, n, relay.pid) for _ in range(rounds)]
                seconds = sorted(t for r in tries for t in r.pop("puller_s"))
                r = {
                    **sorted(tries, key=lambda t: t["goodput_Bps"])[len(tries) // 2],  # the median round
                    "goodput_Bps_rounds": [t["goodput_Bps"] for t in tries],
                    "p50_s": _quantile(seconds, 0.50),
                    "p99_s": _quantile(seconds, 0.99),
                    "relay_peak_rss_bytes": max(t["relay_peak_rss_bytes"] for t in tries),
                    "relay_peak_fds": max(t["relay_peak_fds"] for t in tries),
                    "relay_fds_after": max(t["relay_fds_after"] for t in tries),
                }
                out["fan_out"][kind][n] = r
                print(_row(kind, str(n), r), file=sys.stderr, flush=True)
        out["relay_vm_hwm_bytes"] = _status(relay.pid, "VmHWM")
        out["relay_fds_after"] = len(os.listdir(f"/proc/{relay.pid}/fd"))
        return out
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 16 MB base, one round (under a minute)")
    ap.add_argument("--out", type=Path, required=True, help="where the JSON goes")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sprl-scale-relay-") as tmp:
        result = run(a.quick, Path(tmp))
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"scale_relay: wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
