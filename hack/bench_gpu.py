#!/usr/bin/env python3
"""GPU benchmark: diff (compare + compaction + copy of the changes to the host) of a realistic
bf16 step of >= 1e9 elements, beside the device-to-device copy of the same buffers; also the
full encode with CUDA inputs, the device state hash, and the delta applied in place into a CUDA
copy of the base (checked bit for bit and by hash). Target: diff >= 1 TB/s on an H200."""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import cupy
import torch

from sparrowrl.delta import DeltaFile, DeltaWriter, apply_delta, gpu, state_hash
from sparrowrl.delta.context import field
from sparrowrl.delta.statehash import TensorKey
from sparrowrl.delta.tensors import TensorSpec


def timed(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=1 << 30)
    ap.add_argument("--out", type=Path, default=Path("bench_gpu.json"))
    args = ap.parse_args()
    n = args.elements
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, device="cuda", generator=g) * 0.02).bfloat16().float()
    old = w.bfloat16()
    w -= 1e-6 * torch.randn(n, device="cuda", generator=g).sign()  # Adam-like: |update| ~ lr
    new = w.bfloat16()
    del w
    nbytes = n * 2
    dst = torch.empty_like(old)
    t_copy = timed(lambda: dst.copy_(old))
    a, b = gpu.device_bits(old), gpu.device_bits(new)
    from sparrowrl.delta.extract import changed_positions

    t_kernel = timed(lambda: changed_positions(cupy, a, b))
    t_diff = timed(lambda: gpu.extract_tensor(old, new, 1 << 22, field("BF16")), reps=3)  # with classes and ranks
    changed = int(changed_positions(cupy, a, b).shape[0])

    base, want = state_hash({"w": old}), state_hash({"w": new})

    def encode() -> bytes:
        buf = io.BytesIO()
        wr = DeltaWriter(buf, [TensorSpec("w", "BF16", (n,))], base_version=0, base_hash=base, target_version=1)
        wr.add([("w", old, new)])
        wr.close()
        return buf.getvalue()

    t0 = time.perf_counter()
    data = encode()
    t_encode = time.perf_counter() - t0
    size = len(data)
    target = old.clone()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    got = apply_delta(DeltaFile(data), {"w": target}, base_hash=base)  # parses, decodes, locates, assigns
    torch.cuda.synchronize()
    t_apply = time.perf_counter() - t0
    exact = got == want and bool(torch.equal(target.view(torch.int16), new.view(torch.int16)))
    key = TensorKey("w", "BF16", (n,), 2)
    t_hash = timed(lambda: gpu.tensor_hash(key, a), reps=3)
    r = {
        "elements": n,
        "changed": changed,
        "density": changed / n,
        "delta_bytes": size,
        "bytes_per_changed": size / changed,
        "device_copy_TBps": nbytes / t_copy / 1e12,
        "diff_kernel_TBps": nbytes / t_kernel / 1e12,
        "diff_to_host_TBps": nbytes / t_diff / 1e12,
        "encode_GBps": nbytes / t_encode / 1e9,
        "state_hash_TBps": nbytes / t_hash / 1e12,
        "apply_GBps": nbytes / t_apply / 1e9,
        "applied_bit_exact": exact,
        "device": torch.cuda.get_device_name(),
    }
    for k, v in r.items():
        print(f"{k:>20}: {v:.4g}" if isinstance(v, float) else f"{k:>20}: {v}")
    args.out.write_text(json.dumps(r, indent=1))
    if not exact:
        raise SystemExit("the delta applied on the GPU does not reproduce the new state")


if __name__ == "__main__":
    main()
