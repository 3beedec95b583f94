#!/usr/bin/env python3
"""The operator under many jobs, and the size of a job's status under many workers.

1. Jobs: the emulated clusters of the operator's tests (tests/support/kube.py: kmock's emulator,
   one per cluster, on loopback), a home cluster and two members (`east`, `west`, as SparrowClusters,
   as tests/test_operator_e2e.py sets them up), and the operator as its own process (`kopf run`'s
   `kopf.operator`, with the production Config: a reconcile every 10 s per job, a probe every 30 s
   per member). N SparrowRLJobs of 4 placements each (home, east, west, east; 1 worker and a
   relay each: 9 pods a job) are created at once. No kubelet runs (tests/support/kubelet.py would
   start every pod as a real process): pods stay Pending, and a trainer.service.url stands in for
   the load balancer address the kubelet would give the trainer's Service, so the member pods are
   made at once. What is measured is the operator's own work:
   - the time from the first job applied to every pod of every job created, and the API requests
     that took;
   - the reconcile cycle: each call of `Operator.reconcile_job` timed in the operator's process
     (per job: its distribution; for all: cycles a second against the N/interval wanted, and the
     busy fraction of the operator's reconcile time);
   - the API requests per cycle in steady state, by verb and resource, counted by the emulators
     (`Emulator.served`: every request each cluster received, kopf's watches and patches included);
   - the operator process's memory, VmRSS and VmHWM from /proc, before the jobs and after.
2. Status: the pure decisions (`reconcile` with a trainer's /v1/status of 1,000 and 4,000 workers,
   some of them bad) → the custom resource's status: its bytes as JSON, the workers it lists (the
   worst 64, checked), its counts, and the time of the call.

    python hack/scale_operator.py [--quick] --out FILE.json

`--quick`: 20 jobs and a 20 s window (under 3 minutes on 2 cores); else 100 jobs and 60 s.
hack/bench_scale.py imports `run(quick, tmp)`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import copy
import datetime
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATHS = [str(ROOT / "runtime"), str(ROOT / "operator"), str(ROOT / "tests")]  # this checkout's, not an install's
sys.path[:0] = PATHS

import yaml  # noqa: E402

NS = "default"
JOBS = "sparrowrl.dev/v1alpha1/sparrowrljobs"
INTERVAL = 10.0  # the operator's Config defaults: a reconcile every 10 s per job
PROBE_INTERVAL = 30.0
PLACEMENTS = [("us", None), ("eu", "east"), ("sa", "east"), ("ap", "west")]
PODS_PER = {"home": 3, "east": 4, "west": 2}  # per job: trainer + relay + worker at home; relay + worker a placement
STATUS_LIMIT = 64 << 10


def log(msg: str) -> None:
    print(f"[scale_operator {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def job(i: int) -> dict:
    return {
        "apiVersion": "sparrowrl.dev/v1alpha1",
        "kind": "SparrowRLJob",
        "metadata": {"name": f"scale-{i:03d}", "namespace": NS},
        "spec": {
            "steps": 60,
            "seed": 1,
            "model": {"tiny": {"hidden": 32, "layers": 1, "heads": 2}},
            "task": {"builtin": "add"},
            "grpo": {"groupSize": 4, "promptsPerStep": 4, "maxNewTokens": 3, "learningRate": 1e-3},
            "trainer": {"service": {"url": f"http://scale-{i:03d}.trainer.example:8470"}},
            "placements": [{"region": r, "replicas": 1, **({"cluster": c} if c else {})} for r, c in PLACEMENTS],
        },
    }


# --- the operator, as its own process ---


def serve_operator(kubeconfig: Path, cycles: Path) -> None:
    """The operator as `kopf run` runs it (tests/support/operator_run.py, in a process of its own),
    each reconcile timed into `cycles`: one line each, "job monotonic-end seconds"."""
    import kopf

    from sparrowrl_operator.clusters import connect
    from sparrowrl_operator.handlers import Config, Operator, register

    config = yaml.safe_load(kubeconfig.read_text())
    op = Operator(Config(image="sparrowrl-runtime:scale"), connect(config))
    out, lock = cycles.open("a", buffering=1), threading.Lock()
    inner = op.reconcile_job

    def timed(body, patch, logger) -> None:
        t0 = time.perf_counter()
        try:
            inner(body, patch, logger)
        finally:
            dt = time.perf_counter() - t0
            with lock:
                out.write(f"{body['metadata']['name']} {time.monotonic():.4f} {dt:.6f}\n")

    op.reconcile_job = timed  # the handlers call op.reconcile_job when they run
    registry = kopf.OperatorRegistry()
    register(registry, op)

    @kopf.on.login(registry=registry)
    def login(**_) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=config["clusters"][0]["cluster"]["server"], token="emulated")

    asyncio.run(kopf.operator(registry=registry, clusterwide=True, standalone=True))


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU time of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def served(cluster) -> collections.Counter:
    """What the emulator received so far, by (verb, resource, item or collection)."""

    async def snapshot() -> collections.Counter:
        out: collections.Counter = collections.Counter()
        for s, n in cluster.emulator.served.items():
            plural = getattr(s.resource, "plural", None) or "discovery"
            verb = {"GET": "get" if s.name else "list/watch", "POST": "create", "DELETE": "delete"}.get(
                s.method, "apply" if s.method == "PATCH" and s.field_manager else s.method.lower()
            )
            out[f"{verb} {plural}"] += n
        return out

    return cluster.call(snapshot())


def pods_in(cluster) -> int:
    """Pods the emulator holds (read on its own loop: not a request, so not counted)."""
    from support.kube import PODS

    async def count() -> int:
        return sum(
            1 for key in list(cluster.emulator.objects) if key[0] == PODS and not cluster.emulator.objects[key].deleted
        )

    return cluster.call(count())


def read_cycles(path: Path) -> list[tuple[str, float, float]]:
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            out.append((parts[0], float(parts[1]), float(parts[2])))
    return out


def summary(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    return {
        "n": len(s),
        "mean_ms": round(1e3 * statistics.fmean(s), 2),
        "p50_ms": round(1e3 * s[len(s) // 2], 2),
        "p95_ms": round(1e3 * s[min(len(s) - 1, math.ceil(0.95 * len(s)) - 1)], 2),
        "max_ms": round(1e3 * s[-1], 2),
    }


def operator_scale(n_jobs: int, window: float, tmp: Path) -> dict:
    from support.kube import clusters, until
    from support.operator_run import add_member

    tmp.mkdir(parents=True, exist_ok=True)
    cycles_file, err = tmp / "cycles.txt", tmp / "operator.log"
    cycles_file.write_text("")
    with clusters("home", "east", "west") as (home, east, west):
        by_name = {"home": home, "east": east, "west": west}
        add_member(home, east, "east")
        add_member(home, west, "west")
        config = tmp / "kubeconfig"
        config.write_text(yaml.safe_dump(home.kubeconfig()))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([*PATHS, os.environ.get("PYTHONPATH", "")]))
        with err.open("w") as stderr:
            child = subprocess.Popen(
                [sys.executable, __file__, "--serve-operator", str(config), "--cycles", str(cycles_file)],
                env=env,
                stdout=stderr,
                stderr=stderr,
                start_new_session=True,
            )
        try:
            log(f"operator started (pid {child.pid}); waiting for both members to connect")

            def connected() -> bool:
                if child.poll() is not None:
                    raise RuntimeError(f"the operator exited: {err.read_text()[-2000:]}")
                for name in ("east", "west"):
                    conds = (
                        (home.get("sparrowrl.dev/v1alpha1/sparrowclusters", None, name) or {}).get("status") or {}
                    ).get("conditions") or []
                    if not any(c["type"] == "Active" and c["status"] == "True" for c in conds):
                        return False
                return True

            until(connected, 60, "both members connected", every=0.2)
            idle = memory(child.pid)
            before = {n: served(c) for n, c in by_name.items()}
            cpu0 = cpu_seconds(child.pid), cpu_seconds()
            log(f"connected; operator VmRSS {idle['VmRSS'] / 1024:.1f} MiB; creating {n_jobs} jobs")
            t0 = time.monotonic()
            for i in range(n_jobs):
                home.create(job(i))
            applied = time.monotonic() - t0
            want = {n: PODS_PER[n] * n_jobs for n in by_name}
            last_report, have = 0.0, {}
            deadline = t0 + max(120.0, 3.0 * n_jobs)
            while time.monotonic() < deadline:
                have = {n: pods_in(c) for n, c in by_name.items()}
                if have == want:
                    break
                if time.monotonic() - last_report > 5:
                    last_report = time.monotonic()
                    log(f"  {time.monotonic() - t0:5.1f} s: pods {have} of {want}")
                time.sleep(0.25)
            all_created = time.monotonic() - t0 if have == want else None
            created = {n: served(c) for n, c in by_name.items()}
            cpu1 = cpu_seconds(child.pid), cpu_seconds()
            log(
                f"all {sum(want.values())} pods created {all_created:.1f} s after the first job"
                if all_created is not None
                else f"not every pod was created within {deadline - t0:.0f} s: {have} of {want}"
            )
            creation_calls = sum((created[n] - before[n] for n in by_name), collections.Counter())
            settle = INTERVAL  # one round of timers after the creation cycles
            log(f"settling {settle:.0f} s, then a steady window of {window:.0f} s")
            time.sleep(settle)
            w0, start = {n: served(c) for n, c in by_name.items()}, time.monotonic()
            cpu2 = cpu_seconds(child.pid), cpu_seconds()
            time.sleep(window)
            w1, end = {n: served(c) for n, c in by_name.items()}, time.monotonic()
            cpu3 = cpu_seconds(child.pid), cpu_seconds()
            mem = memory(child.pid)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
            try:
                child.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    cycles = read_cycles(cycles_file)
    in_window = [(j, t, d) for j, t, d in cycles if start <= t < end]
    creation = [(j, t, d) for j, t, d in cycles if t0 <= t < t0 + (all_created or 0)]
    steady_calls = sum((w1[n] - w0[n] for n in by_name), collections.Counter())
    per_cluster = {n: sum((w1[n] - w0[n]).values()) for n in by_name}
    n_cycles = len(in_window)
    busy = sum(d for _, _, d in in_window)
    per_job = collections.Counter(j for j, _, _ in in_window)
    return {
        "jobs": n_jobs,
        "placements_per_job": len(PLACEMENTS),
        "pods_per_job": sum(PODS_PER.values()),
        "pods_wanted": want,
        "pods_created": have,
        "kubelet": "none: pods stay Pending (no trainer runs, so no /v1/status is fetched)",
        "interval_s": INTERVAL,
        "apply_all_jobs_s": round(applied, 3),
        "all_pods_created_s": None if all_created is None else round(all_created, 2),
        "creation": {
            "cycles": len(creation),
            "operator_cpu_s": round(cpu1[0] - cpu0[0], 2),
            "emulators_cpu_s": round(cpu1[1] - cpu0[1], 2),  # this process: the three clusters' loops
            "operator_cpu_ms_per_job": round(1e3 * (cpu1[0] - cpu0[0]) / n_jobs, 1),
            "cycle_time": summary([d for *_, d in creation]),
            "api_calls": sum(creation_calls.values()),
            "api_calls_per_job": round(sum(creation_calls.values()) / n_jobs, 1),
            "by_kind": dict(creation_calls.most_common()),
        },
        "steady": {
            "window_s": round(end - start, 1),
            "cycles": n_cycles,
            "cycles_per_s": round(n_cycles / (end - start), 2),
            "cycles_per_s_wanted": round(n_jobs / INTERVAL, 2),
            "jobs_cycled": len(per_job),
            "cycle_time": summary([d for *_, d in in_window]),
            "reconcile_busy_fraction": round(busy / (end - start), 3),  # wall time in reconcile_job / window
            "operator_cpu_s": round(cpu3[0] - cpu2[0], 2),
            "operator_cpu_fraction": round((cpu3[0] - cpu2[0]) / (end - start), 3),  # of one core
            "operator_cpu_ms_per_cycle": round(1e3 * (cpu3[0] - cpu2[0]) / n_cycles, 1) if n_cycles else None,
            "emulators_cpu_fraction": round((cpu3[1] - cpu2[1]) / (end - start), 3),
            "all_jobs_round_s": round(busy / n_cycles * n_jobs, 3) if n_cycles else None,
            "api_calls": sum(steady_calls.values()),
            "api_calls_per_cycle": round(sum(steady_calls.values()) / n_cycles, 2) if n_cycles else None,
            "by_kind_per_cycle": {k: round(v / n_cycles, 2) for k, v in steady_calls.most_common()} if n_cycles else {},
            "by_cluster": per_cluster,
        },
        "operator_memory_kib": {"connected_idle": idle, "end": mem},
        "memory_how": "the operator's own process (kopf.operator), /proc/PID/status VmRSS and VmHWM",
    }


# --- the status of a job of thousands of workers ---


def status_size(workers: int) -> dict:
    """The custom resource's status for a trainer reporting `workers` workers, a few of them bad
    (their names sort last, so a list by name would miss them), from the pure `reconcile`."""
    from sparrowrl.spec.status import TrainerStatus, WorkerStatus
    from sparrowrl_operator.builders import stored
    from sparrowrl_operator.model import MAX_LISTED
    from sparrowrl_operator.reconcile import Observed, reconcile

    t0 = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.timezone.utc)
    regions = math.ceil(workers / 64)
    body = copy.deepcopy(job(0))
    body["metadata"] |= {"name": "big", "uid": "u-big", "generation": 1}
    body["spec"]["trainer"] = {}
    body["spec"]["placements"] = [
        {"region": f"r{i:02d}", "replicas": min(64, workers - 64 * i), "minReplicas": 0} for i in range(regions)
    ]
    pods: dict[str, dict] = {}
    objects: dict = {}

    def step(seconds: float, trainer: TrainerStatus | None = None) -> tuple[dict, float]:
        obs = Observed(
            now=t0 + datetime.timedelta(seconds=seconds),
            token="tok",
            pods={None: [copy.deepcopy(p) for p in pods.values()]},
            objects={None: copy.deepcopy(objects)},
            trainer=trainer,
        )
        t = time.perf_counter()
        plan = reconcile(body, obs, "sparrowrl-runtime:scale")
        dt = time.perf_counter() - t
        for _, m in plan.create:
            if m["kind"] == "Pod":
                pods.setdefault(m["metadata"]["name"], m)
            else:
                objects[m["kind"], m["metadata"]["name"]] = stored(m)
        for _, m in plan.apply:
            objects[m["kind"], m["metadata"]["name"]] = stored(m)
        body["status"] = plan.status.model_dump(by_alias=True, exclude_none=True, mode="json")
        return body["status"], dt

    step(0)
    step(0)
    for p in pods.values():
        p["status"] = {
            "phase": "Running",
            "startTime": t0.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "conditions": [{"type": "Ready", "status": "True"}],
        }
    names = sorted(n for n in pods if "-worker-" in n)
    assert len(names) == workers, (len(names), workers)
    bad = names[-40:]  # sort last by name
    mismatched, stale, behind, refusing = bad[:5], bad[5:15], bad[15:30], bad[30:40]
    trainer = TrainerStatus(
        phase="Running",
        step=50,
        steps=60,
        version=50,
        leases_active=workers,
        workers=[
            WorkerStatus(
                name=n,
                region=n.split("-worker-")[1].split("-")[0],
                committed_version=45 if n in behind else 50,
                staleness=5 if n in behind else 0,
                last_verification="mismatch" if n in mismatched else "ok",
                seconds_since_seen=400.0 if n in stale else 1.5,
                leases_held=1,
                refused_answers=3 if n in refusing else 0,
            )
            for n in names
        ],
    )
    body["spec"]["health"] = {"onStale": "Ignore"}  # the stale stay, and are counted
    status, dt = step(310, trainer)  # the trainer up past staleAfterSeconds (300)
    listed = [w["name"] for w in status["progress"]["workers"]]
    worst_first = (
        listed[:5] == sorted(mismatched)
        and set(listed[5:15]) == set(stale)
        and set(listed[15:30]) == set(behind)
        and set(listed[30:40]) == set(refusing)
    )
    size = len(json.dumps(status, separators=(",", ":")).encode())
    return {
        "workers": workers,
        "placements": regions,
        "status_bytes": size,
        "under_64KiB": size < STATUS_LIMIT,
        "listed": len(listed),
        "listed_bound": MAX_LISTED,
        "worst_listed_first": worst_first,
        "first_listed": listed[:3],
        "worker_counts": status["progress"].get("workerCounts"),
        "stale_listed": len(status["leases"]["staleWorkers"]),
        "weights_in_sync": next(
            (f"{c['status']} {c['reason']}" for c in status["conditions"] if c["type"] == "WeightsInSync"), None
        ),
        "reconcile_s": round(dt, 3),
    }


# --- the report ---


def table(result: dict) -> str:
    lines = []
    op = result["operator"]
    mem = op["operator_memory_kib"]
    lines.append(
        f"operator: {op['jobs']} jobs x {op['placements_per_job']} placements over 3 clusters "
        f"({op['pods_per_job']} pods a job), interval {op['interval_s']:.0f} s, {op['kubelet']}"
    )
    rows = [
        ("apply all jobs", f"{op['apply_all_jobs_s']:.2f} s"),
        (
            "all pods created after first apply",
            "-" if op["all_pods_created_s"] is None else f"{op['all_pods_created_s']:.1f} s",
        ),
        ("pods created / wanted", f"{sum(op['pods_created'].values())} / {sum(op['pods_wanted'].values())}"),
        ("creation: API calls per job", f"{op['creation']['api_calls_per_job']}"),
        ("creation: cycle p50 / p95 / max", _ms(op["creation"]["cycle_time"])),
        ("steady: cycles/s (wanted)", f"{op['steady']['cycles_per_s']} ({op['steady']['cycles_per_s_wanted']})"),
        ("steady: cycle p50 / p95 / max", _ms(op["steady"]["cycle_time"])),
        ("creation: operator CPU per job", f"{op['creation']['operator_cpu_ms_per_job']} ms"),
        ("steady: one round of all jobs", f"{op['steady']['all_jobs_round_s']} s of reconcile time"),
        ("steady: reconcile busy fraction", f"{op['steady']['reconcile_busy_fraction']}"),
        ("steady: operator CPU per cycle", f"{op['steady']['operator_cpu_ms_per_cycle']} ms"),
        (
            "steady: CPU of a core, operator / emulators",
            f"{op['steady']['operator_cpu_fraction']} / {op['steady']['emulators_cpu_fraction']}",
        ),
        ("steady: API calls per cycle", f"{op['steady']['api_calls_per_cycle']}"),
        (
            "operator VmRSS idle -> end (VmHWM)",
            f"{mem['connected_idle']['VmRSS'] / 1024:.1f} -> "
            f"{mem['end']['VmRSS'] / 1024:.1f} MiB ({mem['end']['VmHWM'] / 1024:.1f})",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    lines.append("  steady API calls per cycle, by kind:")
    lines += [f"    {v:7.2f}  {k}" for k, v in op["steady"]["by_kind_per_cycle"].items()]
    lines.append("status of a job (the CR's, from the trainer's /v1/status):")
    lines.append(f"  {'workers':>7}  {'bytes':>7}  {'listed':>6}  {'worst first':>11}  {'reconcile':>9}  counts")
    for s in result["status"]:
        c = s["worker_counts"] or {}
        lines.append(
            f"  {s['workers']:>7}  {s['status_bytes']:>7}  {s['listed']:>6}  {str(s['worst_listed_first']):>11}  "
            f"{s['reconcile_s']:>8.3f}s  total {c.get('total')}, live {c.get('live')}, stale {c.get('stale')}, "
            f"mismatched {c.get('mismatched')}, behind {c.get('behind')}, refusing {c.get('refusing')}"
        )
    return "\n".join(lines)


def _ms(s: dict) -> str:
    return "-" if not s.get("n") else f"{s['p50_ms']} / {s['p95_ms']} / {s['max_ms']} ms (n={s['n']})"


def run(quick: bool, tmp: Path) -> dict:
    """Both measurements; `quick`: 20 jobs and a 20 s window, else 100 jobs and 60 s."""
    n_jobs, window = (20, 20.0) if quick else (100, 60.0)
    log("status sizes for 1,000 and 4,000 workers")
    sizes = []
    for n in (1000, 4000):
        s = status_size(n)
        sizes.append(s)
        log(f"  {n} workers: {s['status_bytes']} bytes, {s['listed']} listed, reconcile {s['reconcile_s']} s")
    log(f"operator under {n_jobs} jobs")
    op = operator_scale(n_jobs, window, Path(tmp) / "operator")
    return {"quick": quick, "operator": op, "status": sizes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="20 jobs and a 20 s window")
    ap.add_argument("--out", type=Path, help="the JSON results")
    ap.add_argument("--serve-operator", type=Path, help=argparse.SUPPRESS)  # the operator's own process
    ap.add_argument("--cycles", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_operator:
        serve_operator(args.serve_operator, args.cycles)
        return
    if args.out is None:
        ap.error("--out is required")
    with tempfile.TemporaryDirectory(prefix="scale-operator-") as tmp:
        result = run(args.quick, Path(tmp))
    print(table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
