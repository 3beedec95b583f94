#!/usr/bin/env python3
"""End-to-end benchmark: one RL job, three ways, on the same emulated WAN, in one run.

  full    every step ships the whole bf16 policy over the WAN links (4 streams, relays), and
          workers generate once it has arrived: the usual full-weight broadcast
  sparse  everything on: sparse deltas, cut-through, 4 streams, relays, staleness 1, the
          balanced scheduler, leases
  ideal   the sparse job on unshaped links: weight sync at (nearly) zero cost, the stand-in for
          one datacenter

Without --quick, ablations follow, each one mechanism off beside `sparse`: 1 stream, no relays,
pull instead of the scheduler, staleness 0, store-and-forward; and `full + overlap`, full
weights with sparse's staleness 1.

Three regions of two workers, each region behind one WAN link to the trainer (hack/wan:
network namespaces, htb, each flow capped at a quarter of its link). The links are scaled so
that a full broadcast takes about 2.8 rollout batches, as 16 GB at 1 Gbit/s does against a 45 s
rollout batch in the published setup. In each region one worker is 4 times slower than the
other.

What is real and what is paced (2 cores are shared by every process here, where a real job has
an accelerator per worker):
- real: the trainer's GRPO steps, extraction and encoding, every byte on the wire over shaped
  TCP links, relays, decoding and applying, the hash checks, the coordinator;
- paced: each worker's generation is held to its pace in tokens/s (`sparrowrl worker
  --pace-tokens-per-s`), the time a dedicated accelerator would take, the same in all runs.
  The real generation is faster; a worker logs any lease that was not, and the JSON counts
  them (`leases_over_pace`).

Needs root (namespaces). Writes --json FILE:
  {"modes": {"full": {"tokens_per_s": ..., "steps": ..., ...}, "sparse": {...}, "ideal": {...}},
   "ablations": {...}, "config": {...}}

    sudo python3 hack/bench_e2e.py --quick --json out.json     # under 10 minutes on 2 cores
    sudo python3 hack/bench_e2e.py                              # and the ablations (~30 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import in_venv  # noqa: E402 (hack/ is this script's folder, first on sys.path)

in_venv.enter()

import yaml  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "wan"))
from wan import ORIGIN, Region, Wan, flow_port  # noqa: E402

EXE = str(Path(sys.executable).parent / "sparrowrl")
TOKEN = "bench-e2e"
REGIONS = ("us", "eu", "ap")
SPEEDS = (1.0, 0.25)  # each region's two workers: one at the pace, one at a quarter of it (4:1)
TRAINER_PORT, RELAY_PORT = 8470, 8471
RATIO = 2.8  # full broadcast over rollout batch, as in the published setup
GOODPUT = 0.96  # TCP goodput over an htb class, of its rate (hack/wan/README.md)
PHASES = ("rollout", "generate", "train", "extract", "transfer", "wait", "step")


@dataclass(frozen=True)
class Variant:
    """One way to run the job: `sparse` is everything on; each other changes what it names."""

    mode: str = "sparse"  # sync.mode
    staleness: int = 1
    streams: int = 4
    relays: bool = True
    split: str = "balanced"
    cut_through: bool = True
    shaped: bool = True  # False: the links are not shaped (ideal)


MODES = {
    "full": Variant(mode="full", staleness=0),  # the usual baseline: broadcast the weights, then generate
    "sparse": Variant(),
    "ideal": Variant(shaped=False),
}
ABLATIONS = {
    "full + overlap": Variant(mode="full"),  # full weights, with sparse's staleness 1
    "1 stream": Variant(streams=1),
    "no relays": Variant(relays=False),
    "pull split": Variant(split="pull"),
    "staleness 0": Variant(staleness=0),
    "store-and-forward": Variant(cut_through=False),
}


def job(cfg: dict, name: str, v: Variant) -> dict:
    return {
        "apiVersion": "sparrowrl.dev/v1alpha1",
        "kind": "SparrowRLJob",
        "metadata": {"name": "e2e-" + "".join(c if c.isalnum() else "-" for c in name)},
        "spec": {
            "steps": cfg["steps"],
            "seed": cfg["seed"],
            "model": {"tiny": cfg["model"]},
            "task": {"builtin": "add"},
            "grpo": {
                "learningRate": cfg["learning_rate"],
                "groupSize": cfg["group_size"],
                "promptsPerStep": cfg["prompts_per_step"],
                "maxNewTokens": cfg["max_new_tokens"],
            },
            "rollout": {"groupsPerLease": 4, "split": v.split, "leaseSeconds": 600},
            "sync": {"mode": v.mode, "streams": v.streams, "staleness": v.staleness, "cutThrough": v.cut_through},
            "topology": {"regions": [{"name": r, "workers": len(SPEEDS), "relay": v.relays} for r in REGIONS]},
        },
    }


def dense_bytes(model: dict) -> int:
    """The bf16 policy's size: what a full broadcast ships per step."""
    from sparrowrl.trainer import models

    tok = models.char_tokenizer()
    m = models.tiny_qwen3(len(tok), model["hidden"], model["layers"], model["heads"], seed=0)
    return 2 * sum(t.numel() for t in models.policy_state(m).values())


def run(name: str, v: Variant, cfg: dict, root: Path) -> dict:
    """One job on a fresh WAN; its trainer's metrics rows and summary."""
    d = root / "".join(c if c.isalnum() else "-" for c in name)
    d.mkdir()
    (d / "job.yaml").write_text(yaml.safe_dump(job(cfg, name, v), sort_keys=False))
    env = dict(os.environ, SPARROWRL_TOKEN=TOKEN, PYTHONUNBUFFERED="1")
    link = cfg["link_mbit"] if v.shaped else None
    regions = [Region(r, link_mbit=link, per_flow_mbit=link / 4 if link else None) for r in REGIONS]
    t0 = time.perf_counter()
    with Wan(regions=regions) as wan:
        origin = f"http://{wan.addr(ORIGIN)}:{TRAINER_PORT}"

        def start(ns: str, log: str, argv: list[str]):
            return wan.popen(ns, [EXE, *argv], env=env, stdout=open(d / f"{log}.log", "w"), stderr=subprocess.STDOUT)

        def ports(first: int) -> str:  # one per stream, each its own per-flow class (hack/wan/README.md)
            return ",".join(str(flow_port(first + s)) for s in range(v.streams))

        trainer = start(
            ORIGIN,
            "trainer",
            [
                "trainer",
                str(d / "job.yaml"),
                "--state-dir",
                str(d / "state"),
                "--host",
                "0.0.0.0",
                "--port",
                str(TRAINER_PORT),
            ],
        )
        for r in REGIONS:
            if v.relays:
                start(
                    r,
                    f"relay-{r}",
                    [
                        "relay",
                        "--upstream",
                        origin,
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(RELAY_PORT),
                        "--streams",
                        str(v.streams),
                        "--local-ports",
                        ports(8),
                    ],
                )
            for k, speed in enumerate(SPEEDS):
                source = ["--relay", f"http://127.0.0.1:{RELAY_PORT}"] if v.relays else ["--local-ports", ports(4 * k)]
                start(
                    r,
                    f"worker-{r}-{k}",
                    [
                        "worker",
                        "--trainer",
                        origin,
                        *source,
                        "--name",
                        f"worker-{r}-{k}",
                        "--region",
                        r,
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(8480 + k),
                        "--pace-tokens-per-s",
                        str(cfg["pace"] * speed),
                    ],
                )
        summary = d / "state" / "summary.json"
        while not summary.exists():
            if trainer.poll() is not None:
                sys.exit(
                    f"{name}: the trainer exited ({trainer.returncode}):\n" + (d / "trainer.log").read_text()[-3000:]
                )
            if time.perf_counter() - t0 > cfg["run_timeout_s"]:
                sys.exit(f"{name}: not done after {cfg['run_timeout_s']} s; logs in {d}")
            rows = d / "state" / "metrics.jsonl"
            n = len(rows.read_text().splitlines()) if rows.exists() else 0
            print(f"\r  {name:18} {n:3}/{cfg['steps']} steps {time.perf_counter() - t0:5.0f} s", end="", flush=True)
            time.sleep(1)
        print(f"\r  {name:18} {cfg['steps']:3}/{cfg['steps']} steps {time.perf_counter() - t0:5.0f} s")
        trainer.wait(timeout=60)
    rows = [json.loads(x) for x in (d / "state" / "metrics.jsonl").read_text().splitlines()]
    logs = list(d.glob("worker-*.log"))
    return {
        "rows": rows,
        "summary": json.loads(summary.read_text()),
        "wall_s": time.perf_counter() - t0,
        "leases_over_pace": sum(p.read_text().count("pace missed") for p in logs),
    }


def measure(r: dict, skip: int) -> dict:
    """A mode's figures over its steady steps (the first `skip` start the pipeline)."""
    rows, s = r["rows"], r["summary"]
    steady = rows[skip:]
    seconds = sum(x["step_s"] for x in steady)
    return {
        "steps": len(rows),
        "tokens_per_s": sum(x["tokens"] for x in steady) / seconds,
        "step_s": seconds / len(steady),
        "phases_s": {p: statistics.mean(x[f"{p}_s"] or 0.0 for x in steady) for p in PHASES},
        "payload_bytes": statistics.mean(x["payload_bytes"] for x in steady),
        "changed_fraction": statistics.mean(x["changed_fraction"] for x in steady),
        "reward": [x["reward_mean"] for x in rows],
        "prompt_groups_lost": s["prompt_groups_lost"],
        "commits_verified": s["weights_verified"],
        "commits_mismatched": s["weights_mismatch"],
        "final_state_hash": s["final_state_hash"],
        "leases_over_pace": r["leases_over_pace"],
        "wall_s": r["wall_s"],
    }


def agreement(a: list[float], b: list[float]) -> dict:
    """Whether two reward curves of the same job and seed agree within noise: the difference of
    their means against twice its standard error, from the step-to-step spread of each curve
    (steps are correlated, so this is a rough bound, not a test)."""
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    se = (statistics.variance(a) / n + statistics.variance(b) / n) ** 0.5
    diff = statistics.mean(b) - statistics.mean(a)
    return {
        "steps": n,
        "mean_full": statistics.mean(a),
        "mean_sparse": statistics.mean(b),
        "diff": diff,
        "two_standard_errors": 2 * se,
        "agree": abs(diff) <= 2 * se,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="the three modes, fewer steps, no ablations: under 10 minutes on 2 cores"
    )
    ap.add_argument("--json", type=Path, default=Path("docs/bench_e2e.json"))
    ap.add_argument("--only", help="comma-separated runs, e.g. full,sparse (default: all)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_e2e needs root for its network namespaces: sudo python3 hack/bench_e2e.py ...")
    model = {"hidden": 256, "layers": 4, "heads": 4, "warmupSteps": 300}  # decaying: as 150 at a constant rate
    cfg = {
        "quick": a.quick,
        "steps": 12 if a.quick else 24,
        "skip": 3,
        "seed": 0,
        "model": model,
        "learning_rate": 6e-7,
        "group_size": 8,
        "prompts_per_step": 32,
        "max_new_tokens": 4,
        "pace": 64.0,
        "regions": list(REGIONS),
        "worker_speeds": list(SPEEDS),
        "run_timeout_s": 900,
    }
    # The rollout batch's paced time, from its tokens (answers to `add` run ~3.2 tokens), and links
    # scaled so that a full broadcast takes RATIO of it.
    batch_tokens = cfg["prompts_per_step"] * cfg["group_size"] * 3.2
    cfg["rollout_batch_s"] = batch_tokens / (cfg["pace"] * sum(SPEEDS) * len(REGIONS))
    cfg["dense_bytes"] = dense_bytes(model)
    cfg["link_mbit"] = round(cfg["dense_bytes"] * 8 / (RATIO * cfg["rollout_batch_s"]) / GOODPUT / 1e6, 2)
    cfg["per_flow_mbit"] = cfg["link_mbit"] / 4
    print(
        f"policy {cfg['dense_bytes'] / 1e6:.1f} MB bf16; rollout batch ~{cfg['rollout_batch_s']:.1f} s paced; "
        f"links {cfg['link_mbit']} Mbit/s, {cfg['per_flow_mbit']:.2f} per flow"
    )
    runs = {**MODES, **({} if a.quick else ABLATIONS)}
    if a.only:
        runs = {k: runs[k] for k in a.only.split(",")}
    out: dict = {"config": cfg, "variants": {k: asdict(v) for k, v in runs.items()}, "modes": {}, "ablations": {}}
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        for name, v in runs.items():
            out["modes" if name in MODES else "ablations"][name] = measure(run(name, v, cfg, Path(tmp)), cfg["skip"])
    every = {**out["modes"], **out["ablations"]}
    for x in every.values():
        if "full" in every:
            x["speedup_over_full"] = x["tokens_per_s"] / every["full"]["tokens_per_s"]
        if "ideal" in every:
            x["below_ideal"] = 1 - x["tokens_per_s"] / every["ideal"]["tokens_per_s"]
        if "sparse" in every:
            x["vs_sparse"] = x["tokens_per_s"] / every["sparse"]["tokens_per_s"]
    if "full" in every and "sparse" in every:
        out["reward_agreement"] = agreement(every["full"]["reward"], every["sparse"]["reward"])
        print(f"reward, full vs sparse: {out['reward_agreement']}")
    print(
        f"\n{'run':18} {'tokens/s':>9} {'step s':>7} {'payload B':>11} {'changed':>8} {'vs full':>8} "
        f"{'below ideal':>11} {'lost':>5} {'commits ok/bad':>14}"
    )
    for name, x in every.items():
        print(
            f"{name:18} {x['tokens_per_s']:9.1f} {x['step_s']:7.2f} {x['payload_bytes']:11,.0f} "
            f"{x['changed_fraction']:8.2%} {x.get('speedup_over_full', float('nan')):7.2f}x "
            f"{x.get('below_ideal', float('nan')):11.1%} {x['prompt_groups_lost']:5} "
            f"{x['commits_verified']:9}/{x['commits_mismatched']}"
        )
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
