#!/usr/bin/env python3
"""Scale: how far one trainer, one relay and one operator go, and what grows with what.

1. The trainer's control plane under load. A real `sparrowrl trainer` (tiny model, real GRPO
   steps, real deltas, its journal and store on disk) and, in this process, N simulated
   workers that speak the worker protocol over loopback, each with its own worker token: they
   commit every version (with the state hash of weights that one real subscriber here pulls
   and applies through the relay-less origin), lease, wait out a paced generation, and post
   results. The fleet's speed is fixed: P prompt groups a step, generated in GEN_S seconds by
   the whole fleet, whatever N; so the trainer trains the same batch at every size, and only
   the number of workers changes. Each lease takes its mean time within ±`--jitter` (25%):
   with one group a worker, a step then waits on the slowest of N groups, the fleet's own
   stragglers; `--jitter 0` leaves the trainer's share alone. The first WARM steps are left
   out (the scheduler probes new workers, leases ramp up).

   Latency is the trainer's own: a request's time less the wait it asked for (a long poll for
   work, a commit ahead of the store), which the trainer states in its `Server-Timing` header.

2. A relay under fan-out (scale_relay.py); 3. the operator under many jobs (scale_operator.py).

    python3 hack/bench_scale.py --quick --out /tmp/scale.json     # under 10 minutes
    python3 hack/bench_scale.py --quick --only trainer --jitter 0 --out /tmp/steady.json
    python3 hack/bench_scale.py --out docs/bench_scale.json --plot docs/bench_scale.png
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import resource
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import in_venv  # noqa: E402 (hack/ is this script's folder, first on sys.path)

in_venv.enter()

import aiohttp  # noqa: E402
import yaml  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from sparrowrl.auth.signing import Signer, public_text  # noqa: E402
from sparrowrl.auth.tokens import mint  # noqa: E402
from sparrowrl.cli.runner import free_port  # noqa: E402
from sparrowrl.delta import state_hash  # noqa: E402
from sparrowrl.sync import Subscriber  # noqa: E402
from sparrowrl.transport.http import freeze_heap  # noqa: E402

EXE = str(Path(sys.executable).parent / "sparrowrl")
SECRET = "bench-scale-" + secrets.token_hex(8)
VOCAB = range(3, 52)  # the tiny model's character tokens (models.char_tokenizer)
ROUTES = ("/v1/work", "/v1/results", "/v1/commit")
FETCH_S = 3.0  # a worker holds a version up to this long (uniformly) after the real subscriber: a real
# model's delta across regions (docs/benchmarks.md projects 0.8 s for 8B at 1 Gbit/s, 3.4 s at 0.25)


def job(workers: int, groups: int, steps: int, group_size: int, new_tokens: int) -> dict:
    regions, left, i = [], workers, 0
    while left:  # a topology holds 64 workers a region at most
        n = min(64, left)
        regions.append({"name": f"r{i}", "workers": n, "relay": False})
        left, i = left - n, i + 1
    return {
        "apiVersion": "sparrowrl.dev/v1alpha1",
        "kind": "SparrowRLJob",
        "metadata": {"name": f"scale-{workers}"},
        "spec": {
            "steps": steps,
            "seed": 0,
            "model": {"tiny": {"hidden": 64, "layers": 2, "heads": 2}},
            "task": {"builtin": "add"},
            "grpo": {
                "learningRate": 1e-5,
                "groupSize": group_size,
                "promptsPerStep": groups,
                "maxNewTokens": new_tokens,
            },
            "rollout": {"groupsPerLease": groups, "leaseSeconds": 120},
            "sync": {"staleness": 1, "streams": 1},
            "trainer": {"checkpoint": {"every": steps}},  # no checkpoint mid-run: the journal only grows
            "topology": {"regions": regions},
        },
    }


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Proc:
    """A child's CPU seconds and peak memory, from /proc."""

    def __init__(self, pid: int):
        self.pid = pid

    def cpu_s(self) -> float:
        f = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    def status(self, key: str) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))


class Fleet:
    """N simulated workers and one real subscriber, against one trainer."""

    def __init__(self, url: str, n: int, per_group_s: float, group_size: int, new_tokens: int, jitter: float):
        self.url, self.n, self.per_group_s, self.jitter = url, n, per_group_s, jitter
        self.group_size, self.new_tokens = group_size, new_tokens
        signer = Signer(SECRET)
        self.tokens = {f"w{i:05d}": mint(signer, "worker", f"w{i:05d}") for i in range(n)}
        self.key = public_text(signer.key)
        self.hashes: dict[int, str] = {}  # version → the state hash the real subscriber computed
        self.seen_at: dict[int, float] = {}  # version → when the subscriber had it
        self.fetch_s: dict[int, float] = {}
        self.new_version = asyncio.Condition()
        self.lat: dict[str, list[float]] = {r: [] for r in ROUTES}  # seconds, less the trainer's stated wait
        self.work_lat: dict[str, list[float]] = {}  # /v1/work's, by answer: lease, update, wait, done
        self.lease_groups: dict[int, int] = {}  # groups in a lease → leases measured
        self.measuring = False
        self.counts = {"admitted": 0, "refused": 0, "verified": 0, "mismatched": 0}
        self.errors: list[str] = []
        self.rng = random.Random(0)

    async def post(self, s: aiohttp.ClientSession, route: str, worker: str, body: dict) -> dict:
        headers = {"Authorization": f"Bearer {self.tokens[worker]}", "Idempotency-Key": secrets.token_hex(8)}
        for attempt in range(20):
            t0 = time.perf_counter()
            try:
                async with s.post(self.url + route, json=body, headers=headers) as r:
                    if r.status != 200:
                        raise RuntimeError(f"{route} {worker}: {r.status} {(await r.text())[:200]}")
                    ans = await r.json()
                    waited = float(r.headers.get("Server-Timing", "wait;dur=0").split("dur=")[1]) / 1000
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                if attempt == 19:
                    raise
                self.errors.append(f"{route}: {type(e).__name__} {e}"[:200])
                await asyncio.sleep(0.5)
                continue
            if self.measuring:
                self.lat[route].append(took := time.perf_counter() - t0 - waited)
                if route == "/v1/work":
                    self.work_lat.setdefault(next(iter(ans)), []).append(took)
            return ans
        raise AssertionError

    async def follow(self, base: dict) -> None:
        """The real subscriber: every version applied and hashed, as a worker's weights would be."""
        async with Subscriber(self.url, base, held=0, token=SECRET, trainer_key=self.key) as sub:
            async for v in sub.follow(after=0):
                staged = await sub.fetch(v)
                await asyncio.to_thread(sub.apply, staged)
                h = await asyncio.to_thread(state_hash, base)
                async with self.new_version:
                    self.hashes[v], self.seen_at[v], self.fetch_s[v] = h, time.perf_counter(), staged.fetch_s
                    self.new_version.notify_all()

    async def until_version(self, v: int) -> None:
        async with self.new_version:
            await self.new_version.wait_for(lambda: max(self.hashes, default=-1) >= v)

    async def worker(self, s: aiohttp.ClientSession, name: str) -> None:
        """As `worker.py` does: a version is fetched in the background (here: it is staged 0 to
        FETCH_S seconds after the real subscriber has it) and committed between leases once
        staged; a worker told to update, or that the job is done, waits for it."""
        version = -1
        fetch: dict[int, float] = {}  # version → seconds this worker stages it after the subscriber

        def staged_at(v: int) -> float:
            if v not in fetch:
                fetch[v] = self.rng.uniform(0, FETCH_S)
            return self.seen_at[v] + fetch[v]

        async def commit(upto: int) -> None:
            nonlocal version
            for u in [upto] if version < 0 else range(version + 1, upto + 1):
                body = {"worker": name, "version": u, "state_hash": self.hashes[u]}
                body["fetch_s"] = self.fetch_s[u] + staged_at(u) - self.seen_at[u]
                ans = await self.post(s, "/v1/commit", name, body)
                self.counts["verified" if ans["verified"] else "mismatched"] += 1
                version = u

        async def reach(v: int) -> None:
            await self.until_version(v)
            upto = max(self.hashes) if version < 0 else v  # a starting worker takes the newest
            wanted = [upto] if version < 0 else range(version + 1, upto + 1)
            await asyncio.sleep(max(0.0, max((staged_at(u) for u in wanted), default=0.0) - time.perf_counter()))
            await commit(upto)

        await reach(0)
        while True:
            upto = version  # what is staged by now, in order
            while upto + 1 in self.hashes and staged_at(upto + 1) <= time.perf_counter():
                upto += 1
            if upto > version:
                await commit(upto)
            ans = await self.post(s, "/v1/work", name, {"worker": name, "version": version, "region": "r0"})
            if "done" in ans:
                await reach(ans["done"])
                return
            if "update" in ans:
                await reach(ans["update"])
            elif "lease" in ans:
                lease = ans["lease"]
                t0 = time.perf_counter()
                if self.measuring:
                    k = len(lease["groups"])
                    self.lease_groups[k] = self.lease_groups.get(k, 0) + 1
                # the paced generation, each lease within `jitter` of its mean (completions differ in length)
                spread = self.rng.uniform(1 - self.jitter, 1 + self.jitter)
                await asyncio.sleep(self.per_group_s * len(lease["groups"]) * spread)
                results = {
                    str(g): {
                        "samples": [
                            {
                                "tokens": [self.rng.choice(VOCAB) for _ in range(self.new_tokens)],
                                "logprobs": [-1.0] * self.new_tokens,
                            }
                            for _ in range(self.group_size)
                        ]
                    }
                    for g in lease["groups"]
                }
                ans = await self.post(
                    s,
                    "/v1/results",
                    name,
                    {
                        "lease": lease["id"],
                        "worker": name,
                        "version": version,
                        "state_hash": self.hashes[version],
                        "results": results,
                        "generate_s": time.perf_counter() - t0,
                    },
                )
                self.counts["admitted"] += ans["admitted"]
                self.counts["refused"] += 1 if ans.get("refused") else 0


async def lag(into: list[float]) -> None:
    """This process's own event-loop lag: what it adds to every latency it measures."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(0.01)
        into.append(time.perf_counter() - t - 0.01)


async def status_probe(s: aiohttp.ClientSession, url: str) -> tuple[int, float]:
    t0 = time.perf_counter()
    async with s.get(url + "/v1/status", headers={"Authorization": f"Bearer {SECRET}"}) as r:
        body = await r.read()
    return len(body), time.perf_counter() - t0


async def drive(url: str, d: Path, n: int, a: argparse.Namespace, proc: Proc) -> dict:
    per_group_s = a.gen_s * n / a.groups
    fleet = Fleet(url, n, per_group_s, a.group_size, a.new_tokens, a.jitter)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        while True:  # the trainer is up once it serves version 0
            try:
                async with s.get(url + "/readyz") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if proc_gone(proc):
                raise SystemExit(f"the trainer exited: {(d / 'trainer.log').read_text()[-3000:]}")
            await asyncio.sleep(0.3)
        base = load_file(next((d / "state" / "store" / "bases").glob("v00000000*.safetensors")))
        fleet.hashes[0], fleet.seen_at[0], fleet.fetch_s[0] = state_hash(base), time.perf_counter(), 0.0
        follower = asyncio.create_task(fleet.follow(base))
        lags: list[float] = []
        lagging = asyncio.create_task(lag(lags))
        freeze_heap()  # the modules imported: the collector's full passes over them would pause this loop
        workers = [asyncio.create_task(fleet.worker(s, w)) for w in fleet.tokens]
        status_sizes, status_s, journal, cpu, marks, last_probe = [], [], {}, {}, {}, 0.0
        t0 = time.perf_counter()
        while not all(w.done() for w in workers):
            await asyncio.sleep(0.25)
            for w in workers:
                if w.done() and w.exception():
                    follower.cancel()
                    raise w.exception()
            newest = max(fleet.hashes)
            if newest not in marks:  # a step boundary: what the trainer has used so far
                marks[newest] = time.perf_counter()
                jp = d / "state" / "journal.jsonl"
                journal[newest] = jp.stat().st_size if jp.exists() else 0
                cpu[newest] = proc.cpu_s()
                fleet.measuring = newest >= a.warm
                print(
                    f"\r  {n:>5} workers: v{newest}/{a.steps}, {time.perf_counter() - t0:.0f} s, "
                    f"{fleet.counts['admitted']} groups admitted",
                    end="",
                    flush=True,
                )
            if fleet.measuring and time.perf_counter() - last_probe > 2:  # a scrape every 2 s
                last_probe = time.perf_counter()
                size, secs = await status_probe(s, url)
                status_sizes.append(size)
                status_s.append(secs)
        follower.cancel()
        lagging.cancel()
        gc.unfreeze()  # this run's session, tasks and subscriber: collectable again
        print()
    return {
        "lag": lags,
        "fleet": fleet,
        "status_bytes": status_sizes,
        "status_s": status_s,
        "journal": journal,
        "cpu": cpu,
    }


def proc_gone(proc: Proc) -> bool:
    return not Path(f"/proc/{proc.pid}").exists()


def trainer_run(n: int, a: argparse.Namespace, root: Path) -> dict:
    d = root / f"w{n}"
    d.mkdir()
    (d / "job.yaml").write_text(yaml.safe_dump(job(n, a.groups, a.steps, a.group_size, a.new_tokens)))
    port = free_port()
    log = open(d / "trainer.log", "w")
    p = subprocess.Popen(
        [EXE, "trainer", str(d / "job.yaml"), "--state-dir", str(d / "state"), "--port", str(port)],
        env=dict(os.environ, SPARROWRL_TOKEN=SECRET, PYTHONUNBUFFERED="1"),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    proc = Proc(p.pid)
    me0 = resource.getrusage(resource.RUSAGE_SELF)
    try:
        out = asyncio.run(drive(f"http://127.0.0.1:{port}", d, n, a, proc))
        deadline = time.monotonic() + 60
        while not (d / "state" / "summary.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        rss, fds = proc.status("VmHWM"), proc.fds()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
        p.wait()
    me1 = resource.getrusage(resource.RUSAGE_SELF)
    fleet: Fleet = out["fleet"]
    rows = [json.loads(x) for x in (d / "state" / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((d / "state" / "summary.json").read_text())
    measured = [r for r in rows if r["version"] > a.warm]
    first, last = a.warm, a.steps - 1  # journal and CPU between these versions' arrival
    steps_between = last - first
    j, c = out["journal"], out["cpu"]
    span = (
        max(fleet.seen_at[last] - fleet.seen_at[first], 1e-9)
        if last in fleet.seen_at and first in fleet.seen_at
        else None
    )
    requests = sum(len(v) for v in fleet.lat.values())
    res = {
        "workers": n,
        "groups_per_step": a.groups,
        "per_group_s": fleet.per_group_s,
        "jitter": fleet.jitter,
        "requests_per_s": requests / span if span else None,
        "latency_ms": {
            r: {
                "n": len(xs),
                "p50": 1000 * pct(xs, 0.5),
                "p99": 1000 * pct(xs, 0.99),
                "max": 1000 * max(xs),
            }
            for r, xs in fleet.lat.items()
            if xs
        },
        "work_by_answer_ms": {
            k: {"n": len(xs), "p50": 1000 * pct(xs, 0.5), "p99": 1000 * pct(xs, 0.99)}
            for k, xs in sorted(fleet.work_lat.items())
        },
        "leases_by_groups": dict(sorted(fleet.lease_groups.items())),
        "step_s": statistics.mean(r["step_s"] for r in measured),
        "step_s_each": [round(r["step_s"], 3) for r in measured],
        "train_s": statistics.mean(r.get("train_s", 0.0) for r in measured),
        "version_interval_s": span / steps_between if span else None,
        "trainer_cpu_per_step_s": (c[last] - c[first]) / steps_between if last in c and first in c else None,
        "trainer_peak_rss_bytes": rss,
        "trainer_fds_at_end": fds,
        "journal_bytes_per_step": (j[last] - j[first]) / steps_between if last in j and first in j else None,
        "status_bytes": pct(out["status_bytes"], 0.5),
        "status_ms": {
            "p50": 1000 * pct(out["status_s"], 0.5) if out["status_s"] else None,
            "p99": 1000 * pct(out["status_s"], 0.99) if out["status_s"] else None,
        },
        "load_loop_lag_ms": {"p50": 1000 * pct(out["lag"], 0.5), "p99": 1000 * pct(out["lag"], 0.99)},
        "load_cpu_s": (me1.ru_utime + me1.ru_stime) - (me0.ru_utime + me0.ru_stime),
        "groups_lost": summary["prompt_groups_lost"],
        "groups_requeued": summary["prompt_groups_requeued"],
        "leases_expired": summary["leases_expired"],
        "commits": {"verified": fleet.counts["verified"], "mismatched": fleet.counts["mismatched"]},
        "results_refused": fleet.counts["refused"],
        "client_retries": len(fleet.errors),
        "final_version": summary["final_version"],
    }
    return res


def show(r: dict) -> None:
    lat = r["latency_ms"]
    cell = lambda k: f"{lat[k]['p50']:6.1f}/{lat[k]['p99']:7.1f}" if k in lat else "-"  # noqa: E731
    print(
        f"  {r['workers']:>5} workers: work {cell('/v1/work')} ms  results {cell('/v1/results')} ms  commit "
        f"{cell('/v1/commit')} ms (p50/p99)  {r['requests_per_s'] or 0:,.0f} req/s  step {r['step_s']:.2f} s  "
        f"trainer CPU {r['trainer_cpu_per_step_s'] or 0:.2f} s/step, "
        f"RSS {r['trainer_peak_rss_bytes'] / 2**20:.0f} MiB  "
        f"journal {r['journal_bytes_per_step'] or 0:,.0f} B/step  status {r['status_bytes'] or 0:,} B "
        f"{r['status_ms']['p50'] or 0:.1f} ms  lost {r['groups_lost']}",
        flush=True,
    )
    by = r["work_by_answer_ms"]
    print(
        "         /v1/work by answer: "
        + ", ".join(f"{k} {x['p50']:.1f}/{x['p99']:.1f} ms ({x['n']})" for k, x in by.items())
        + "; leases by groups: "
        + ", ".join(f"{k}: {n}" for k, n in r["leases_by_groups"].items())
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10, 100 and 1,000 workers; the relay and operator quick")
    ap.add_argument("--workers", type=int, nargs="*", help="the fleet sizes (default: by --quick)")
    ap.add_argument("--only", choices=("trainer", "relay", "operator"), nargs="*")
    ap.add_argument("--out", type=Path, default=Path("bench_scale.json"))
    ap.add_argument("--steps", type=int, help="steps measured, after the warm-up (default: 4 with --quick, else 5)")
    ap.add_argument(
        "--jitter",
        type=float,
        default=0.25,
        help="each lease takes its mean time times 1 ± this, uniformly (0: every lease its mean)",
    )
    ap.add_argument("--plot", type=Path)
    a = ap.parse_args()
    if a.steps is not None and a.steps < 1:
        ap.error("--steps: at least 1")
    a.workers = a.workers or ([10, 100, 1000] if a.quick else [10, 100, 1000, 4000])
    a.groups = max(a.workers)  # every worker has a group a step at the largest size
    a.warm = 2 if a.quick else 3
    a.steps = a.warm + (a.steps if a.steps is not None else 4 if a.quick else 5)
    a.gen_s, a.group_size, a.new_tokens = 8.0, 2, 4
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a connection per simulated worker
    out: dict = {"quick": a.quick, "machine": {"cpus": os.cpu_count()}}
    only = set(a.only or ("trainer", "relay", "operator"))
    with tempfile.TemporaryDirectory(prefix="sparrowrl-scale-") as tmp:
        root = Path(tmp)
        if "trainer" in only:
            print(
                f"trainer: {a.groups} groups a step generated in {a.gen_s} s (±{a.jitter:.0%} a lease) by the fleet, "
                f"{a.steps} steps "
                f"(the first {a.warm} left out)",
                flush=True,
            )
            out["trainer"] = []
            for n in a.workers:
                out["trainer"].append(trainer_run(n, a, root))
                show(out["trainer"][-1])
            ref = out["trainer"][0]["step_s"]
            for r in out["trainer"]:
                r["step_vs_smallest"] = r["step_s"] / ref
        if "relay" in only:
            import scale_relay

            out["relay"] = scale_relay.run(a.quick, root)
        if "operator" in only:
            import scale_operator

            out["operator"] = scale_operator.run(a.quick, root)
    a.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")
    if a.plot and "trainer" in out:
        plot(out, a.plot)


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = out["trainer"]
    n = [r["workers"] for r in t]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for route, style in zip(ROUTES, ("o-", "s-", "^-")):
        ax[0].plot(n, [r["latency_ms"][route]["p99"] for r in t], style, label=f"{route} p99")
    ax[0].axhline(100, color="grey", ls=":", label="100 ms")
    ax[0].set(xscale="log", yscale="log", xlabel="simulated workers", ylabel="ms", title="trainer latency (p99)")
    ax[0].legend()
    ax[1].plot(n, [r["step_s"] for r in t], "o-", label="step time")
    ax[1].plot(n, [r["trainer_cpu_per_step_s"] for r in t], "s-", label="trainer CPU per step")
    ax[1].set(xscale="log", xlabel="simulated workers", ylabel="seconds", title="step time and trainer CPU")
    ax[1].set_ylim(bottom=0)
    ax[1].legend()
    ax[2].plot(n, [r["journal_bytes_per_step"] / 1e6 for r in t], "o-", label="journal MB/step")
    ax[2].plot(n, [r["status_bytes"] / 1e6 for r in t], "s-", label="/v1/status MB")
    ax[2].plot(n, [r["trainer_peak_rss_bytes"] / 1e9 for r in t], "^-", label="trainer peak RSS GB")
    ax[2].set(xscale="log", yscale="log", xlabel="simulated workers", title="what grows with workers")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
