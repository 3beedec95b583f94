#!/usr/bin/env python3
"""Sharded trainer benchmark: the same model trained and published by 1 and by 2 FSDP2 ranks
(real processes, gloo on this machine's CPUs), with the trainer's own code (`sparrowrl.shard`).

Per rank and step:
- step-to-published: the optimizer step (forward, backward, AdamW), then the version's delta
  from every rank's shards into rank 0's store, cut-through;
- where publishing goes: encoding its own shards, the gather of records to rank 0 (the store's
  one writer), rank 0's writes;
- extraction throughput (bf16 elements diffed and encoded per second, as GB/s of the new
  policy's bytes) beside memcpy of the same shard bytes, in the same process and step;
- peak resident memory (ru_maxrss), also above the process's own before it builds its model
  (torch, the process group), beside what the whole model's fp32 weights and AdamW state would
  take, and the elements of parameters this rank holds.

Both runs use FSDP2, 1 rank too, so the difference is the sharding. Weights start random per
shard (no rank ever builds the whole model, also not to initialize it); the learning rate is set
so that about 1% of bf16 elements change per step, as at RL learning rates (measured and printed). Ranks
share this machine's cores: each gets cores / ranks threads.

With --layouts, trainers of several nodes too, each node a process group of its own on this
machine, meeting by the trainer's rendezvous (`2x1`: 2 nodes of 1 rank; `2x1h`: the same under
HSDP), so that publish time per step of 1 node × 2 ranks stands beside 2 nodes × 1 rank.

Then projections from the measured per-rank rates, with their assumptions: Qwen3-8B on 8 GPUs,
and a 70B model on 2 and 4 nodes of 8 GPUs.

    python3 hack/bench_shard.py [--hidden 1024 --layers 8 --steps 4] [--layouts 2,2x1,2x1h]
                                [--json docs/bench_shard.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import in_venv  # noqa: E402 (hack/ is this script's folder, first on sys.path)

in_venv.enter()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from sparrowrl.sync import gather  # noqa: E402
from sparrowrl.trainer import fsdp, models, ranks, rendezvous  # noqa: E402

VOCAB = 4096


def _fill(model: torch.nn.Module) -> None:
    """Random weights, generated per shard: N(0, 0.02), norms 1."""
    for n, p in model.named_parameters():
        first, flat = gather.span(n, p)
        if "norm" in n:
            flat.fill_(1.0)
        else:
            g = torch.Generator().manual_seed(zlib.crc32(n.encode()) + first)
            flat.copy_(torch.empty(flat.shape).normal_(0.0, 0.02, generator=g))


def _rank(rank: int, layout: Layout, port: int, args: argparse.Namespace, out: str) -> None:
    world = layout.world
    os.environ.update(LOCAL_RANK=str(rank))
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=timedelta(minutes=5))
    dist.init_process_group(rendezvous.backend(), store=store, rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        cfg = models.tiny_config(VOCAB, args.hidden, args.layers, args.hidden // 64)
        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # torch, the process group: no model yet
        model = fsdp.build(cfg, _fill, fsdp.mesh(layout.nodes, layout.sharding))
        table = gather.specs(model)
        store = gather.init_store(Path(out) / "store", model, base_every=1_000_000)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        old = gather.policy(model)
        held = sum(flat.numel() for _, flat in old.values())
        rows = []
        for step in range(args.steps + 1):  # step 0 warms up and is not reported
            g = torch.Generator().manual_seed(1000 * step + rank)
            ids = torch.randint(3, VOCAB, (args.batch, args.seq), generator=g).to(fsdp.device())
            dist.barrier()
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            new = gather.policy(model)
            took = gather.publish(store, table, old, new)
            t2 = time.perf_counter()
            copies = [torch.empty_like(flat) for _, flat in new.values()]
            t3 = time.perf_counter()
            for c, (_, flat) in zip(copies, new.values()):
                c.copy_(flat)
            memcpy_s = time.perf_counter() - t3
            del copies
            old = new
            if step:
                rows.append(
                    {
                        "train_s": t1 - t0,
                        "publish_s": t2 - t1,
                        "step_to_published_s": t2 - t0,
                        **took,
                        "encode_gbs": 2 * held / took["encode_s"] / 1e9,
                        "memcpy_gbs": 2 * held / memcpy_s / 1e9,
                    }
                )
        rates = _gather_rates() if world > 1 else None
        state = sum(gather.span(n, p)[1].numel() * 4 for n, p in model.named_parameters())  # fp32 weights
        state += sum(
            gather.span("optimizer state", t)[1].numel() * t.element_size()
            for st in opt.state.values()
            for t in st.values()
            if t.dim()
        )  # AdamW's moments
        state += 2 * 2 * held  # the bf16 policy, this version's and the one before
        changed = None
        if store is not None:
            changed = [store.versions[v].changed / sum(t.numel for t in table) for v in range(2, args.steps + 2)]
        gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        result = {
            "rank": rank,
            "world": world,
            "nodes": layout.nodes,
            "sharding": layout.sharding,
            "held_elements": held,
            "gpu_peak_bytes": gpu,
            "baseline_rss_bytes": baseline,
            "state_bytes": state,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "steps": rows,
            "changed_fraction": changed,
            "delta_bytes": [store.versions[v].delta_bytes for v in range(2, args.steps + 2)] if store else None,
            "elements": sum(t.numel for t in table),
            "gather": rates,
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    ranks.leave()


def _gather_rates() -> dict:
    """The rank-0 gather by itself (gloo, pickled bytes): goodput of 8 MB from each rank, and the
    latency of one call with a few bytes, what each tensor of a version pays."""
    big, small = os.urandom(8 << 20), b"x" * 64
    timings = {}
    for name, payload, reps in (("big", big, 5), ("small", small, 50)):
        out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.gather_object(payload, out, dst=0)
        timings[name] = (time.perf_counter() - t0) / reps
    return {"bytes_per_s": (dist.get_world_size() - 1) * len(big) / timings["big"], "call_s": timings["small"]}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Layout:
    """A trainer's shape: `nodes` × `per_node` ranks (all on this machine: each node a process
    group of its own, as `sparrowrl run` runs them), sharded fully or hybrid (HSDP)."""

    nodes: int
    per_node: int
    sharding: str

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @classmethod
    def parse(cls, text: str) -> Layout:
        """'2' (one node of 2 ranks), '2x1' (2 nodes of 1), '2x1h' (the same, hybrid)."""
        sharding = "hybrid" if text.endswith("h") else "full"
        nodes, _, per = text.rstrip("h").partition("x")
        return cls(int(nodes), int(per), sharding) if per else cls(1, int(nodes), sharding)

    def __str__(self) -> str:
        return f"{self.nodes} node(s) × {self.per_node} rank(s), {self.sharding}"

    @property
    def name(self) -> str:
        if self.nodes == 1:
            return str(self.per_node)
        return f"{self.nodes}x{self.per_node}" + ("-hybrid" if self.sharding == "hybrid" else "")


def run(layout: Layout, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(layout, _port(), args, out), nprocs=layout.world)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(layout.world)]


def mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-7)
    ap.add_argument(
        "--ranks", default="1,2", help="one-node trainer sizes to run, one GPU per rank where there are GPUs"
    )
    ap.add_argument(
        "--layouts",
        help="trainer shapes instead: NxR is N nodes of R ranks (each node its own process group on this machine), "
        "NxRh the same with hybrid sharding, e.g. 2,2x1,2x1h",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    where = (
        f"{torch.cuda.device_count()} GPUs ({torch.cuda.get_device_name()})"
        if torch.cuda.is_available()
        else f"{os.cpu_count()} CPU cores"
    )
    print(
        f"model: Qwen3, hidden {args.hidden}, {args.layers} layers, vocab {VOCAB}; {args.steps} steps of "
        f"{args.batch}x{args.seq} tokens; {where}, {rendezvous.backend()}",
        flush=True,
    )
    report = {"config": vars(args) | {"json": None, "cpus": os.cpu_count()}, "runs": {}}
    for layout in [Layout.parse(x) for x in (args.layouts or args.ranks).split(",")]:
        world = layout.world
        got = run(layout, args)
        elements = got[0]["elements"]
        full_state = elements * 16  # fp32 weights 4, AdamW's two moments 8, two bf16 policies 4: bytes per parameter
        if world > 1:
            g = got[0]["gather"]
            print(
                f"\ngather to rank 0 alone: {g['bytes_per_s'] / 1e9:.2f} GB/s, {1e3 * g['call_s']:.2f} ms per call",
                flush=True,
            )
        changed = got[0]["changed_fraction"]
        print(
            f"\n{layout}: {elements / 1e6:.1f}M parameters; the whole model's fp32 weights, AdamW state and "
            f"bf16 policies {full_state / 2**30:.2f} GiB; changed per step {100 * sum(changed) / len(changed):.2f}%, "
            f"delta {got[0]['delta_bytes'][-1] / 1e6:.2f} MB",
            flush=True,
        )
        for r in got:
            s = r["steps"]
            if r["gpu_peak_bytes"] is not None:
                print(f"  rank {r['rank']}: GPU memory peak {r['gpu_peak_bytes'] / 2**30:.2f} GiB", flush=True)
            print(
                f"  rank {r['rank']}: holds {r['held_elements'] / 1e6:.1f}M elements, "
                f"{r['state_bytes'] / 2**30:.2f} GiB of weights, AdamW state and bf16 policy; peak RSS "
                f"{r['peak_rss_bytes'] / 2**30:.2f} GiB, {(r['peak_rss_bytes'] - r['baseline_rss_bytes']) / 2**30:.2f} "
                f"above the process before its model; step-to-published {mean(s, 'step_to_published_s'):.2f} s "
                f"(train {mean(s, 'train_s'):.2f}, publish {mean(s, 'publish_s'):.3f}: encode "
                f"{mean(s, 'encode_s'):.3f}, gather {mean(s, 'gather_s'):.3f}, write {mean(s, 'write_s'):.3f}); "
                f"extraction {mean(s, 'encode_gbs'):.2f} GB/s beside memcpy {mean(s, 'memcpy_gbs'):.2f} GB/s "
                f"({100 * mean(s, 'encode_gbs') / mean(s, 'memcpy_gbs'):.0f}%)",
                flush=True,
            )
        report["runs"][layout.name] = got
    one, two = report["runs"].get("2"), report["runs"].get("2x1")
    if one and two:
        p1, p2 = (max(mean(r["steps"], "publish_s") for r in got) for got in (one, two))
        print(f"\npublish per step, slowest rank: 1 node × 2 ranks {p1:.3f} s, 2 nodes × 1 rank {p2:.3f} s")
        report["publish_s"] = {"1x2": p1, "2x1": p2}
    if "2" in report["runs"]:
        report["projection"] = project(report["runs"]["2"], args)
        report["projection_nodes"] = project_nodes(report["runs"]["2"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.json}")


def project(got: list[dict], args: argparse.Namespace) -> dict:
    """Qwen3-8B on 8 GPUs, per step, from this run's 2-rank rates. Assumptions, stated: training
    takes 15 s per step (hack/project.py's 8B assumption: a third of a 45 s rollout); 1.4% of
    elements change (the e2e run's measured density); each rank extracts at the measured
    per-rank CPU rate times the cores it would have (16 per rank), or at 200 GB/s on the GPU
    (CuPy, never yet measured on a GPU: an assumption); records reach rank 0 at the gather's
    measured goodput, and it writes them at the measured write rate."""
    n, world, density, train_s, cores = 8.03e9, 8, 0.014, 15.0, 16
    sent = sum(mean(r["steps"], "sent_bytes") for r in got)
    changed = got[0]["changed_fraction"][-1] * got[0]["elements"]
    bytes_per_changed = sent / changed
    rank0 = got[0]["steps"]
    gather_rate, call_s = got[0]["gather"]["bytes_per_s"], got[0]["gather"]["call_s"]
    write_rate = sent / max(mean(rank0, "write_s"), 1e-9)
    calls = -(-n // gather.GATHER_ELEMENTS)  # one gather per group of tensors
    per_core = min(mean(r["steps"], "encode_gbs") for r in got) / max(1, (os.cpu_count() or 1) // len(got))
    delta = n * density * bytes_per_changed
    out = {}
    for name, rate in (("cpu", per_core * cores), ("gpu", 200.0)):
        extract_s = 2 * n / world / (rate * 1e9)
        gather_s = delta * (world - 1) / world / gather_rate + calls * call_s
        write_s = delta / write_rate
        out[name] = {
            "extract_s": extract_s,
            "gather_s": gather_s,
            "write_s": write_s,
            "publish_s": extract_s + gather_s + write_s,
            "step_s": train_s + extract_s + gather_s + write_s,
        }
    out["assumptions"] = {
        "params": n,
        "ranks": world,
        "density": density,
        "train_s": train_s,
        "cores_per_rank": cores,
        "gpu_extract_gbs": 200.0,
        "measured": {
            "bytes_per_changed": bytes_per_changed,
            "gather_bytes_per_s": gather_rate,
            "gather_call_s": call_s,
            "write_bytes_per_s": write_rate,
            "extract_gbs_per_core": per_core,
        },
        "delta_bytes": delta,
    }
    print(
        f"\nprojection, Qwen3-8B on 8 GPUs ({density:.1%} changed, {delta / 1e6:.0f} MB delta, training "
        f"assumed {train_s:.0f} s):"
    )
    for name in ("cpu", "gpu"):
        p = out[name]
        print(
            f"  extraction on {name}: extract {p['extract_s']:.2f} s + gather {p['gather_s']:.2f} s + write "
            f"{p['write_s']:.2f} s = publish {p['publish_s']:.2f} s; step {p['step_s']:.1f} s"
        )
    return out


def project_nodes(got: list[dict]) -> dict:
    """A 70B model (70.6e9 parameters) on 2 and 4 nodes of 8 GPUs, publish time per step from this
    run's 2-rank rates. Assumptions, stated: 1.4% of elements change; each rank extracts its
    1/world of the policy at 200 GB/s on its GPU (an assumption, as in `project`); rank 0 gathers
    every other rank's records at the measured gather goodput, and those of other nodes also cross
    the link between nodes (25 or 100 Gbit/s), one after the other (no overlap assumed); rank 0
    writes at the measured rate. Full sharding and HSDP publish the same: each element is encoded
    once either way (gather.part)."""
    n, density, gpu_rate = 70.6e9, 0.014, 200.0
    sent = sum(mean(r["steps"], "sent_bytes") for r in got)
    bytes_per_changed = sent / (got[0]["changed_fraction"][-1] * got[0]["elements"])
    gather_rate, call_s = got[0]["gather"]["bytes_per_s"], got[0]["gather"]["call_s"]
    write_rate = sent / max(mean(got[0]["steps"], "write_s"), 1e-9)
    delta = n * density * bytes_per_changed
    calls = -(-n // gather.GATHER_ELEMENTS)
    out: dict = {"assumptions": {"params": n, "density": density, "gpu_extract_gbs": gpu_rate, "delta_bytes": delta}}
    print(f"\nprojection, a 70B model on nodes of 8 GPUs ({density:.1%} changed, {delta / 1e9:.2f} GB delta):")
    for nodes in (2, 4):
        world = 8 * nodes
        for gbit in (25, 100):
            extract_s = 2 * n / world / (gpu_rate * 1e9)
            gather_s = delta * (world - 1) / world / gather_rate + calls * call_s
            link_s = delta * (nodes - 1) / nodes / (gbit * 1e9 / 8)
            write_s = delta / write_rate
            total = extract_s + gather_s + link_s + write_s
            out[f"{nodes}x8@{gbit}gbit"] = {
                "extract_s": extract_s,
                "gather_s": gather_s,
                "link_s": link_s,
                "write_s": write_s,
                "publish_s": total,
            }
            print(
                f"  {nodes} nodes × 8 GPUs, {gbit} Gbit/s between nodes: extract {extract_s:.2f} s + gather "
                f"{gather_s:.2f} s + between nodes {link_s:.2f} s + write {write_s:.2f} s = publish {total:.2f} s"
            )
    return out


if __name__ == "__main__":
    main()
