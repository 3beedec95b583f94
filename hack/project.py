#!/usr/bin/env python3
"""A model of the step time from measured parts, checked against this machine's runs of
hack/bench_e2e.py, then projected to real model sizes and links.

The model (one trainer, workers in regions behind WAN links, a relay per region):

    chain  = train + sync + apply           what must happen between a batch's end and the
             sync = max(extract, transfer)   cut-through: the wire starts with the first chunk
             sync = extract + transfer       store-and-forward, and full weights (a base is
                                             written, then sent)
    step   = max(rollout, transfer, train + extract, (rollout + chain) / (staleness + 1))

Each of the workers, the links and the trainer is a pipeline stage that a step passes once, so
a step takes at least as long as each of them. And with staleness s, batch b+s+1 needs the
version trained from batch b, so s+1 steps cover one rollout plus the chain; with s = 0 every
step pays it whole.

Parts and where they come from:
- rollout: the batch's tokens over the workers' tokens/s (on this machine, the workers' paces);
- train: measured (bench_e2e rows) here; a parameter for real models;
- extract: dense bytes over the diff + encode rate of hack/bench_codec.py (docs/bench_codec.json),
  and writing a base for full weights at the same rate;
- transfer: bytes over the link's goodput: 4 streams fill 0.93 of a link whose flows are capped
  at a quarter (hack/bench_transfer.py, docs/bench_transfer.json); 1 stream gets a quarter.
  Without relays each region's link carries one copy per worker;
- apply: payload-side decode + apply rate from bench_codec (a delta), or a load at memcpy speed
  (full weights); small beside the rest.

    python3 hack/project.py [--e2e docs/bench_e2e.json] [--out docs/bench_projection.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


@dataclass(frozen=True)
class Rates:
    extract_Bps: float  # dense bytes per second diffed and encoded
    apply_Bps: float  # dense bytes per second decoded and applied
    of_link: dict[int, float]  # streams → goodput as a share of the link


def rates(codec: dict, transfer: dict) -> Rates:
    s = codec["scenarios"][0]["v1"]  # the e2e runs that calibrate the model shipped format 1
    wan = transfer["wan"]
    return Rates(
        s["diff_encode_GBps"] * 1e9,
        s["decode_apply_GBps"] * 1e9,
        {int(k): v["of_link"] for k, v in wan["streams"].items()},
    )


def step_time(
    rollout: float,
    train: float,
    extract: float,
    transfer: float,
    apply: float,
    staleness: int,
    cut_through: bool = True,
) -> float:
    sync = max(extract, transfer) if cut_through else extract + transfer
    return max(rollout, transfer, train + extract, (rollout + train + sync + apply) / (staleness + 1))


def parts(
    r: Rates, dense: float, payload: float, link_mbit: float | None, full: bool, streams: int = 4, copies: int = 1
) -> dict:
    """extract, transfer and apply seconds for one version."""
    link = None if link_mbit is None else link_mbit * 1e6 / 8 * r.of_link[min(streams, 4)]
    return {
        "extract": dense / r.extract_Bps,
        "transfer": 0.0 if link is None else copies * payload / link,
        "apply": payload / r.apply_Bps if not full else 0.0,
    }


def calibrate(e2e: dict, r: Rates) -> dict:
    """Predicted against measured step times for every run of a bench_e2e JSON."""
    cfg = e2e["config"]
    out = {}
    for name, v in e2e["variants"].items():
        m = {**e2e["modes"], **e2e.get("ablations", {})}[name]
        full = v["mode"] == "full"
        p = parts(
            r,
            cfg["dense_bytes"],
            m["payload_bytes"],
            cfg["link_mbit"] if v["shaped"] else None,
            full,
            v["streams"],
            1 if v["relays"] else len(cfg["worker_speeds"]),
        )
        rollout = m["tokens_per_s"] * m["step_s"] / (cfg["pace"] * sum(cfg["worker_speeds"]) * len(cfg["regions"]))
        predicted = step_time(
            rollout,
            m["phases_s"]["train"],
            p["extract"],
            p["transfer"],
            p["apply"],
            v["staleness"],
            v["cut_through"] and not full,
        )
        out[name] = {
            "predicted_step_s": predicted,
            "measured_step_s": m["step_s"],
            "error": predicted / m["step_s"] - 1,
            "rollout_s": rollout,
            "train_s": m["phases_s"]["train"],
            **{f"{k}_s": x for k, x in p.items()},
        }
    return out


# Real models: parameters, and the published density of changed bf16 elements per step (Qwen3-14B:
# not published in what we could read; 1% assumed).
MODELS = {"Qwen3-4B": (4.02e9, 0.0112), "Qwen3-8B": (8.19e9, 0.0096), "Qwen3-14B": (14.8e9, 0.010)}
ROLLOUT_8B_S = 45.0  # the published setup's rollout batch for 8B
TRAIN_8B_S = 15.0  # assumed: a third of the rollout
LINKS_GBIT = (0.25, 0.5, 1.0, 10.0)
BYTES_PER_CHANGED = 1.25  # codec format 1, as calibrated (formats 2 and 3 ship ~0.5: docs/codec.md)
GPU_EXTRACT_BPS = 200e9  # assumed for an H200: diff + encode at a tenth of its memory bandwidth (not measured)


def project(r: Rates) -> dict:
    """Tokens/s of full and sparse relative to ideal, and sparse over full, per model and link."""
    out = {}
    for model, (params, density) in MODELS.items():
        scale = params / MODELS["Qwen3-8B"][0]  # rollout and train time in proportion to parameters
        rollout, train = ROLLOUT_8B_S * scale, TRAIN_8B_S * scale
        dense, payload = 2 * params, params * density * BYTES_PER_CHANGED
        gpu = Rates(GPU_EXTRACT_BPS, GPU_EXTRACT_BPS, r.of_link)
        ideal = step_time(rollout, train, 0.0, 0.0, 0.0, 1)
        for gbit in LINKS_GBIT:
            f = parts(gpu, dense, dense, gbit * 1e3, full=True)
            s = parts(gpu, dense, payload, gbit * 1e3, full=False)
            full = step_time(rollout, train, f["extract"], f["transfer"], f["apply"], 0, cut_through=False)
            sparse = step_time(rollout, train, s["extract"], s["transfer"], s["apply"], 1)
            out[f"{model} @ {gbit:g} Gbit/s"] = {
                "model": model,
                "link_gbit": gbit,
                "rollout_s": rollout,
                "train_s": train,
                "full_transfer_s": f["transfer"],
                "sparse_transfer_s": s["transfer"],
                "payload_bytes": payload,
                "full_step_s": full,
                "sparse_step_s": sparse,
                "ideal_step_s": ideal,
                "speedup": full / sparse,
                "below_ideal": 1 - ideal / sparse,
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--e2e", type=Path, default=DOCS / "bench_e2e.json")
    ap.add_argument("--codec", type=Path, default=DOCS / "bench_codec.json")
    ap.add_argument("--transfer", type=Path, default=DOCS / "bench_transfer.json")
    ap.add_argument("--out", type=Path, default=DOCS / "bench_projection.json")
    a = ap.parse_args()
    r = rates(json.loads(a.codec.read_text()), json.loads(a.transfer.read_text()))
    cal = calibrate(json.loads(a.e2e.read_text()), r)
    print(f"{'run':18} {'measured s':>10} {'predicted s':>11} {'error':>7}")
    for name, c in cal.items():
        print(f"{name:18} {c['measured_step_s']:10.2f} {c['predicted_step_s']:11.2f} {c['error']:7.1%}")
    proj = project(r)
    print(f"\n{'model @ link':26} {'full s':>7} {'sparse s':>8} {'ideal s':>7} {'speedup':>8} {'below ideal':>11}")
    for name, p in proj.items():
        print(
            f"{name:26} {p['full_step_s']:7.1f} {p['sparse_step_s']:8.1f} {p['ideal_step_s']:7.1f} "
            f"{p['speedup']:7.2f}x {p['below_ideal']:11.1%}"
        )
    assumptions = {
        "rollout_8b_s": ROLLOUT_8B_S,
        "train_8b_s": TRAIN_8B_S,
        "scale": "rollout and train time in proportion to parameters",
        "gpu_extract_Bps": GPU_EXTRACT_BPS,
        "bytes_per_changed": BYTES_PER_CHANGED,
        "models": MODELS,
        "full_baseline": "staleness 0",
        "sparse": "staleness 1, cut-through, 4 streams, one relay per region",
        "ideal": "no sync cost, staleness 1",
    }
    a.out.write_text(json.dumps({"calibration": cal, "projection": proj, "assumptions": assumptions}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
