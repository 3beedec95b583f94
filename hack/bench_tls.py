#!/usr/bin/env python3
"""What TLS costs a pull: each figure over HTTPS beside the same over plain HTTP, in the same run,
rounds interleaved, from the same `sparrowrl serve` (with and without --tls-cert, a certificate of
a CA made for the run, auth/pki.py: ECDSA P-256, TLS 1.3).

  loopback  one process pulls a base (default 512 MiB) with 4 streams, every piece verified:
            HTTPS vs HTTP, and memcpy of the same bytes as the machine's reference
  wan       the same client pulls a 24 MB base with 4 streams over an emulated WAN link (hack/wan,
            needs root; each flow capped at a quarter of the link): HTTPS vs HTTP
  cut       over the same link, a new version pulled cut-through (the client starts while it is
            being written, as a worker does), timed from the start of publishing until the client
            holds it: HTTPS vs HTTP

Prints the figures and writes JSON (default docs/bench_tls.json).

    sudo python3 hack/bench_tls.py [--rounds 5] [--link-mbit 200] [--out docs/bench_tls.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "wan"))
import in_venv  # noqa: E402 (hack/ is this script's folder, first on sys.path)

in_venv.enter()

import torch  # noqa: E402

TOKEN = "bench-token"
EXE = str(Path(sys.executable).parent / "sparrowrl")


async def _pull(url: str, ca: str | None, ports: list[int]) -> dict:
    from sparrowrl.transport.client import Client

    ctx = ssl.create_default_context(cafile=ca) if ca else None
    async with Client(url, token=TOKEN, streams=4, local_ports=ports or None, ssl_context=ctx, attempts=40) as c:
        listing = await c.versions()
        t0 = time.perf_counter()
        await c.base(0, listing)
        return {"bytes": c.stats.bytes, "seconds": time.perf_counter() - t0, "download_s": c.stats.seconds}


def pull_main(argv: list[str]) -> None:
    """`_pull URL [--ca CA] [--ports P...]`: one verified pull of version 0's base; its figures as JSON."""
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--ca")
    ap.add_argument("--ports", type=int, nargs="*", default=[])
    a = ap.parse_args(argv)
    print(json.dumps(asyncio.run(_pull(a.url, a.ca, a.ports))), flush=True)


async def _cut(url: str, ca: str | None, version: int, ports: list[int]) -> dict:
    from sparrowrl.transport.client import Client

    ctx = ssl.create_default_context(cafile=ca) if ca else None
    async with Client(url, token=TOKEN, streams=4, local_ports=ports, ssl_context=ctx, backoff=0.05, attempts=40) as c:
        print("ready", flush=True)
        while True:  # long-poll until the version is being written, then pull it as it is
            listing = await c.versions(after=version - 1, wait=30)
            if listing["newest"] >= version or version in listing["producing"]:
                break
        await c.delta(version)
        return {"t1": time.time(), "bytes": c.stats.bytes}


def cut_main(argv: list[str]) -> None:
    """`_cut URL VERSION [--ca CA] --ports P...`: says ready, pulls VERSION cut-through; its end as JSON."""
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("version", type=int)
    ap.add_argument("--ca")
    ap.add_argument("--ports", type=int, nargs="+")
    a = ap.parse_args(argv)
    print(json.dumps(asyncio.run(_cut(a.url, a.ca, a.version, a.ports))), flush=True)


def pull(run, url: str, ca: Path | None, ports: list[int] = ()) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "_pull", url, *(["--ca", str(ca)] if ca else [])]
    res = run(cmd + (["--ports", *map(str, ports)] if ports else []), capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads(res.stdout.splitlines()[-1])


def wait_https(run, url: str, ca: Path | None) -> None:
    code = (
        "import ssl, sys, urllib.request; "
        f"ctx = ssl.create_default_context(cafile={str(ca)!r}) if {ca is not None} else None; "
        f"req = urllib.request.Request({url + '/v1/versions'!r}, headers={{'Authorization': 'Bearer {TOKEN}'}}); "
        "urllib.request.urlopen(req, timeout=2, context=ctx)"
    )
    deadline = time.time() + 60
    while run([sys.executable, "-c", code], capture_output=True).returncode != 0:
        if time.time() > deadline:
            raise RuntimeError(f"nothing answers at {url}")
        time.sleep(0.2)


def certificates(folder: Path, names: list[str]) -> tuple[Path, Path, Path]:
    from sparrowrl.auth import pki

    ca = pki.authority("bench")
    served = pki.serving(ca, names)
    paths = folder / "ca.crt", folder / "serving.crt", folder / "serving.key"
    for path, data in zip(paths, (ca.cert, served.cert, served.key)):
        path.write_bytes(data)
    return paths


def memcpy_MBps(n: int) -> float:
    src = torch.empty(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    return n / (time.perf_counter() - t0) / 1e6


def compare(rounds: int, pull_plain, pull_tls) -> dict:
    """Interleaved rounds of both; medians of the pulls' goodput (MB/s of verified bytes)."""
    runs: dict[str, list[float]] = {"http": [], "https": []}
    for i in range(rounds):
        for kind, fn in (
            (("http", pull_plain), ("https", pull_tls)) if i % 2 == 0 else (("https", pull_tls), ("http", pull_plain))
        ):
            r = fn()
            runs[kind].append(r["bytes"] / r["download_s"] / 1e6)
        print(
            f"  round {i + 1}/{rounds}: http {runs['http'][-1]:.0f} MB/s, https {runs['https'][-1]:.0f} MB/s",
            file=sys.stderr,
        )
    http, https = statistics.median(runs["http"]), statistics.median(runs["https"])
    return {"rounds": runs, "http_MBps": http, "https_MBps": https, "https_of_http": https / http}


def loopback(store: Path, tmp: Path, rounds: int) -> dict:
    ca, cert, key = certificates(tmp, ["127.0.0.1"])
    env = dict(os.environ, SPARROWRL_TOKEN=TOKEN)
    servers = [
        subprocess.Popen([EXE, "serve", str(store), "--port", "8470"], env=env, stderr=subprocess.DEVNULL),
        subprocess.Popen(
            [EXE, "serve", str(store), "--port", "8471", "--tls-cert", str(cert), "--tls-key", str(key)],
            env=env,
            stderr=subprocess.DEVNULL,
        ),
    ]
    try:
        wait_https(subprocess.run, "http://127.0.0.1:8470", None)
        wait_https(subprocess.run, "https://127.0.0.1:8471", ca)
        out = compare(
            rounds,
            lambda: pull(subprocess.run, "http://127.0.0.1:8470", None),
            lambda: pull(subprocess.run, "https://127.0.0.1:8471", ca),
        )
    finally:
        for s in servers:
            s.kill()
    return out


def wan(store: Path, tmp: Path, rounds: int, link: float, density: float) -> dict:
    from wan import ORIGIN, Wan, flow_port

    env = dict(os.environ, SPARROWRL_TOKEN=TOKEN)
    with Wan(regions=["us"], link_mbit=link, per_flow_mbit=link / 4) as w:
        addr = w.addr(ORIGIN)
        ca, cert, key = certificates(tmp, [addr])
        for port, extra in ((8470, []), (8471, ["--tls-cert", str(cert), "--tls-key", str(key)])):
            cmd = [EXE, "serve", str(store), "--host", "0.0.0.0", "--port", str(port), *extra]
            w.popen(ORIGIN, cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        run = lambda argv, **k: w.run("us", argv, env=env, **k)  # noqa: E731
        wait_https(run, f"http://{addr}:8470", None)
        wait_https(run, f"https://{addr}:8471", ca)
        k = iter(range(4, 64))  # fresh client ports each pull (TIME_WAIT), four flow classes each

        def ports() -> list[int]:
            n = next(k)
            return [flow_port(4 * n + i) for i in range(4)]

        out = compare(
            rounds,
            lambda: pull(run, f"http://{addr}:8470", None, ports()),
            lambda: pull(run, f"https://{addr}:8471", ca, ports()),
        )
        print("emulated WAN: a version pulled cut-through, HTTP and HTTPS ...", file=sys.stderr)
        out["cut_through"] = cut_through(w, env, store, rounds, density, f"{addr}", ca, ports)
    return {"link_mbit": link, "per_flow_mbit": link / 4, **out}


def cut_through(w, env: dict, path: Path, rounds: int, density: float, addr: str, ca: Path, ports) -> dict:
    """Rounds of a new version each, pulled cut-through over HTTP or HTTPS in turn (interleaved):
    seconds from the start of publishing until the client holds it, medians."""
    from sparrowrl.delta.tensors import TensorSpec
    from sparrowrl.store.store import Store

    store = Store(path)
    old = store.materialize(store.newest)["w"]
    g = torch.Generator().manual_seed(1)
    runs: dict[str, list[float]] = {"http": [], "https": []}
    delta_bytes = []
    for i in range(rounds):
        for kind in ("http", "https") if i % 2 == 0 else ("https", "http"):
            new = old.clone()
            bits = new.view(torch.int16)
            at = torch.randperm(len(bits), generator=g)[: int(len(bits) * density)]
            bits[at] = torch.randint(-(2**15), 2**15, (len(at),), generator=g, dtype=torch.int16)
            version = store.newest + 1
            url = f"http://{addr}:8470" if kind == "http" else f"https://{addr}:8471"
            cmd = [sys.executable, str(Path(__file__).resolve()), "_cut", url, str(version)]
            cmd += (["--ca", str(ca)] if kind == "https" else []) + ["--ports", *map(str, ports())]
            p = w.popen("us", cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(p.stderr.read()[-3000:])
            time.sleep(1.0)  # long-polling
            t0 = time.time()
            with store.publish([TensorSpec.of("w", new)]) as writer:  # as the trainer does
                writer.add([("w", old, new)])
            line = p.stdout.readline()
            if p.wait() != 0 or not line:
                raise RuntimeError(p.stderr.read()[-3000:])
            runs[kind].append(json.loads(line)["t1"] - t0)
            delta_bytes.append(store.versions[version].delta_bytes)
            old = new
        print(
            f"  round {i + 1}/{rounds}: http {runs['http'][-1]:.2f} s, https {runs['https'][-1]:.2f} s", file=sys.stderr
        )
    http, https = statistics.median(runs["http"]), statistics.median(runs["https"])
    return {
        "density": density,
        "delta_bytes": statistics.median(delta_bytes),
        "rounds_s": runs,
        "http_s": http,
        "https_s": https,
        "https_time_of_http": https / http,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_pull":
        return pull_main(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "_cut":
        return cut_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--link-mbit", type=float, default=200.0)
    ap.add_argument("--loopback-elements", type=int, default=256 << 20, help="bf16 elements of the loopback base")
    ap.add_argument("--wan-elements", type=int, default=12 << 20, help="bf16 elements of the WAN base (24 MB)")
    ap.add_argument("--density", type=float, default=0.3, help="elements each cut-through version changes")
    ap.add_argument("--out", type=Path, default=HERE.parent / "docs" / "bench_tls.json")
    a = ap.parse_args()
    if not 1 <= a.rounds <= 7:
        ap.error("--rounds: 1 to 7 (the emulated WAN has 60 pulls' worth of fresh flow-classed ports)")
    if not 0 < a.density <= 1:
        ap.error("--density: over 0, at most 1")
    from sparrowrl.store.store import Store

    result: dict = {"machine": platform.processor() or platform.machine(), "tls": "1.3, ECDSA P-256 (auth/pki.py)"}
    with tempfile.TemporaryDirectory(prefix="sprl-tls-") as tmp:
        os.chmod(tmp, 0o755)
        big = Store.init(Path(tmp) / "loopback", {"w": torch.randn(a.loopback_elements).bfloat16()}, base_every=1000)
        result["loopback"] = {
            "base_bytes": big.versions[0].base_bytes,
            "memcpy_MBps": memcpy_MBps(big.versions[0].base_bytes),
        }
        print("loopback: a verified pull, HTTP and HTTPS ...", file=sys.stderr)
        result["loopback"].update(loopback(big.path, Path(tmp), a.rounds))
        if os.geteuid() == 0:
            small = Store.init(Path(tmp) / "wan", {"w": torch.randn(a.wan_elements).bfloat16()}, base_every=1000)
            print(f"emulated WAN ({a.link_mbit:g} Mbit/s): a verified pull, HTTP and HTTPS ...", file=sys.stderr)
            result["wan"] = {
                "base_bytes": small.versions[0].base_bytes,
                **wan(small.path, Path(tmp), a.rounds, a.link_mbit, a.density),
            }
    lo = result["loopback"]
    print(
        f"loopback: HTTP {lo['http_MBps']:.0f} MB/s, HTTPS {lo['https_MBps']:.0f} MB/s ({lo['https_of_http']:.0%}); "
        f"memcpy {lo['memcpy_MBps']:.0f} MB/s"
    )
    if "wan" in result:
        w = result["wan"]
        print(
            f"WAN {w['link_mbit']:g} Mbit/s: HTTP {w['http_MBps'] * 8:.1f} Mbit/s, HTTPS {w['https_MBps'] * 8:.1f} "
            f"Mbit/s ({w['https_of_http']:.0%})"
        )
        c = w["cut_through"]
        print(
            f"WAN cut-through ({c['delta_bytes'] / 1e6:.1f} MB deltas): HTTP {c['http_s']:.2f} s, HTTPS "
            f"{c['https_s']:.2f} s ({c['https_time_of_http']:.0%} of HTTP's time)"
        )
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
