#!/usr/bin/env python3
"""End-to-end benchmark: one RL job, three ways, on the same emulated WAN, in one run.

  full    every step ships the whole bf16 policy over the WAN links (4 streams, relays)
  sparse  everything on: sparse deltas, cut-through, 4 streams, relays, staleness 1, the
          balanced scheduler, leases
  ideal   the sparse job on unshaped links: weight sync at (nearly) zero cost, the stand-in for
          one datacenter

Three regions of two workers, each region behind one WAN link to the trainer (hack/wan:
network namespaces, htb, each flow capped at a quarter of its link). The links are scaled so
that a full broadcast takes about 2.8 rollout batches, as 16 GB at 1 Gbit/s does against a 45 s
rollout batch in the published setup.

What is real and what is paced (2 cores are shared by every process here, where a real job has
an accelerator per worker):
- real: the trainer's GRPO steps, extraction and encoding, every byte on the wire over shaped
  TCP links, relays, decoding and applying, the hash checks, the coordinator;
- paced: each worker's generation is held to PACE tokens/s (`sparrowrl worker
  --pace-tokens-per-s`), the time a dedicated accelerator would take, the same in all modes. The
  real generation is faster; a worker logs any lease that was not, and the JSON counts them.

Needs root (namespaces). Writes --json FILE:
  {"modes": {"full": {"tokens_per_s": ..., "steps": ..., ...}, "sparse": {...}, "ideal": {...}},
   "config": {...}}

    sudo python3 hack/bench_e2e.py --quick --json out.json     # under 10 minutes on 2 cores
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
from pathlib import Path

import in_venv  # noqa: E402 (hack/ is this script's folder, first on sys.path)

in_venv.enter()

import yaml  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "wan"))
from wan import ORIGIN, Region, Wan, flow_port  # noqa: E402

EXE = str(Path(sys.executable).parent / "sparrowrl")
TOKEN = "bench-e2e"
REGIONS = ("us", "eu", "ap")
WORKERS = 2  # per region
TRAINER_PORT, RELAY_PORT = 8470, 8471
RATIO = 2.8  # full broadcast over rollout batch, as in the published setup
GOODPUT = 0.96  # TCP goodput over an htb class, of its rate (hack/wan/README.md)
PHASES = ("rollout", "generate", "train", "extract", "transfer", "wait", "step")


def job(cfg: dict, mode: str) -> dict:
    return {"apiVersion": "sparrowrl.dev/v1alpha1", "kind": "SparrowRLJob", "metadata": {"name": f"e2e-{mode}"},
            "spec": {"steps": cfg["steps"], "seed": cfg["seed"],
                     "model": {"tiny": cfg["model"]}, "task": {"builtin": "add"},
                     "grpo": {"learningRate": cfg["learning_rate"], "groupSize": cfg["group_size"],
                              "promptsPerStep": cfg["prompts_per_step"], "maxNewTokens": cfg["max_new_tokens"]},
                     "rollout": {"groupsPerLease": 4, "split": "balanced", "leaseSeconds": 600},
                     "sync": {"mode": "full" if mode == "full" else "sparse", "streams": 4, "staleness": 1},
                     "topology": {"regions": [{"name": r, "workers": WORKERS} for r in REGIONS]}}}


def dense_bytes(model: dict) -> int:
    """The bf16 policy's size: what a full broadcast ships per step."""
    from sparrowrl import models

    tok = models.char_tokenizer()
    m = models.tiny_qwen3(len(tok), model["hidden"], model["layers"], model["heads"], seed=0)
    return 2 * sum(t.numel() for t in models.policy_state(m).values())


def run_mode(mode: str, cfg: dict, root: Path, shaped: bool) -> dict:
    """One job on a fresh WAN; its trainer's metrics rows and summary."""
    d = root / mode
    d.mkdir()
    (d / "job.yaml").write_text(yaml.safe_dump(job(cfg, mode), sort_keys=False))
    env = dict(os.environ, SPARROWRL_TOKEN=TOKEN, PYTHONUNBUFFERED="1")
    link = cfg["link_mbit"] if shaped else None
    regions = [Region(r, link_mbit=link, per_flow_mbit=link / 4 if link else None) for r in REGIONS]
    t0 = time.perf_counter()
    with Wan(regions=regions) as wan:
        origin = f"http://{wan.addr(ORIGIN)}:{TRAINER_PORT}"

        def start(ns: str, name: str, argv: list[str]):
            return wan.popen(ns, [EXE, *argv], env=env, stdout=open(d / f"{name}.log", "w"),
                             stderr=subprocess.STDOUT)

        trainer = start(ORIGIN, "trainer", ["trainer", str(d / "job.yaml"), "--state-dir", str(d / "state"),
                                            "--host", "0.0.0.0", "--port", str(TRAINER_PORT)])
        for r in REGIONS:
            start(r, f"relay-{r}", ["relay", "--upstream", origin, "--host", "127.0.0.1", "--port", str(RELAY_PORT),
                                    "--streams", "4", "--local-ports", ",".join(str(flow_port(8 + s)) for s in range(4))])
            for k in range(WORKERS):
                start(r, f"worker-{r}-{k}", ["worker", "--trainer", origin, "--relay", f"http://127.0.0.1:{RELAY_PORT}",
                                             "--name", f"worker-{r}-{k}", "--region", r, "--host", "127.0.0.1",
                                             "--port", str(8480 + k), "--pace-tokens-per-s", str(cfg["pace"])])
        summary = d / "state" / "summary.json"
        while not summary.exists():
            if trainer.poll() is not None:
                sys.exit(f"{mode}: the trainer exited ({trainer.returncode}):\n" + (d / "trainer.log").read_text()[-3000:])
            if time.perf_counter() - t0 > cfg["mode_timeout_s"]:
                sys.exit(f"{mode}: not done after {cfg['mode_timeout_s']} s; logs in {d}")
            rows = d / "state" / "metrics.jsonl"
            n = len(rows.read_text().splitlines()) if rows.exists() else 0
            print(f"\r  {mode:6} {n:3}/{cfg['steps']} steps  {time.perf_counter() - t0:5.0f} s", end="", flush=True)
            time.sleep(1)
        print(f"\r  {mode:6} {cfg['steps']:3}/{cfg['steps']} steps  {time.perf_counter() - t0:5.0f} s")
        trainer.wait(timeout=60)
    rows = [json.loads(x) for x in (d / "state" / "metrics.jsonl").read_text().splitlines()]
    logs = [p for p in d.glob("worker-*.log")]
    return {"rows": rows, "summary": json.loads(summary.read_text()), "wall_s": time.perf_counter() - t0,
            "leases_over_pace": sum(p.read_text().count("pace missed") for p in logs)}


def measure(r: dict, skip: int) -> dict:
    """A mode's figures over its steady steps (the first `skip` start the pipeline)."""
    rows, s = r["rows"], r["summary"]
    steady = rows[skip:]
    seconds = sum(x["step_s"] for x in steady)
    return {"steps": len(rows), "tokens_per_s": sum(x["tokens"] for x in steady) / seconds,
            "step_s": seconds / len(steady),
            "phases_s": {p: statistics.mean(x[f"{p}_s"] or 0.0 for x in steady) for p in PHASES},
            "payload_bytes": statistics.mean(x["payload_bytes"] for x in steady),
            "changed_fraction": statistics.mean(x["changed_fraction"] for x in steady),
            "reward": [x["reward_mean"] for x in rows],
            "prompt_groups_lost": s["prompt_groups_lost"], "commits_verified": s["weights_verified"],
            "commits_mismatched": s["weights_mismatch"], "final_state_hash": s["final_state_hash"],
            "leases_over_pace": r["leases_over_pace"], "wall_s": r["wall_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps: under 10 minutes on 2 cores")
    ap.add_argument("--json", type=Path, default=Path("docs/bench_e2e.json"))
    ap.add_argument("--modes", default="full,sparse,ideal")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_e2e needs root for its network namespaces: sudo python3 hack/bench_e2e.py ...")
    model = {"hidden": 256, "layers": 4, "heads": 4, "warmupSteps": 150}
    cfg = {"steps": 12 if a.quick else 40, "skip": 3, "seed": 0, "model": model, "learning_rate": 3e-7,
           "group_size": 8, "prompts_per_step": 32, "max_new_tokens": 4, "pace": 40.0,
           "regions": list(REGIONS), "workers_per_region": WORKERS, "mode_timeout_s": 900}
    # The rollout batch's paced time, from its tokens (answers to `add` run ~3.5 tokens), and links
    # scaled so that a full broadcast takes RATIO of it.
    batch_tokens = cfg["prompts_per_step"] * cfg["group_size"] * 3.5
    cfg["rollout_batch_s"] = batch_tokens / (cfg["pace"] * len(REGIONS) * WORKERS)
    cfg["dense_bytes"] = dense_bytes(model)
    cfg["link_mbit"] = round(cfg["dense_bytes"] * 8 / (RATIO * cfg["rollout_batch_s"]) / GOODPUT / 1e6, 2)
    cfg["per_flow_mbit"] = cfg["link_mbit"] / 4
    print(f"policy {cfg['dense_bytes'] / 1e6:.1f} MB bf16; rollout batch ~{cfg['rollout_batch_s']:.1f} s paced; "
          f"links {cfg['link_mbit']} Mbit/s, {cfg['per_flow_mbit']:.2f} per flow")
    out: dict = {"config": cfg, "modes": {}}
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        for mode in a.modes.split(","):
            r = run_mode(mode, cfg, Path(tmp), shaped=mode != "ideal")
            out["modes"][mode] = measure(r, cfg["skip"])
    m = out["modes"]
    for mode, x in m.items():
        if "full" in m:
            x["speedup_over_full"] = x["tokens_per_s"] / m["full"]["tokens_per_s"]
        if "ideal" in m:
            x["below_ideal"] = 1 - x["tokens_per_s"] / m["ideal"]["tokens_per_s"]
    print(f"\n{'mode':7} {'tokens/s':>9} {'step s':>7} {'payload B':>11} {'changed':>8} {'vs full':>8} "
          f"{'below ideal':>11} {'lost':>5} {'verified':>9}")
    for mode, x in m.items():
        print(f"{mode:7} {x['tokens_per_s']:9.1f} {x['step_s']:7.2f} {x['payload_bytes']:11,.0f} "
              f"{x['changed_fraction']:8.2%} {x.get('speedup_over_full', float('nan')):7.2f}x "
              f"{x.get('below_ideal', float('nan')):11.1%} {x['prompt_groups_lost']:5} "
              f"{x['commits_verified']:4}/{x['commits_mismatched']} ")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
