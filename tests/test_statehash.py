"""The additive state hash: incremental updates equal full recomputation; any bit matters."""

import io

import numpy as np
import torch
from support.tensors import mutated, random_tensor

from sparrowrl.delta import DeltaFile, apply_delta, state_hash, write_delta
from sparrowrl.delta.bitview import bits
from sparrowrl.delta.statehash import TensorKey


def test_every_single_bit_flip_changes_the_hash(rng):
    state = {"w": random_tensor(rng, "BF16", (8, 8)), "v": random_tensor(rng, "F64", (3,))}
    h0 = state_hash(state)
    seen = {h0}
    for name in state:
        b = bits(state[name])
        for i in range(b.shape[0]):
            for bit in range(8 * b.dtype.itemsize):
                b[i] ^= b.dtype.type(1 << bit)
                seen.add(state_hash(state))
                b[i] ^= b.dtype.type(1 << bit)
    assert len(seen) == 1 + 64 * 16 + 3 * 64
    assert state_hash(state) == h0


def test_hash_depends_on_name_shape_and_position(rng):
    t = random_tensor(rng, "BF16", (4, 6))
    base = state_hash({"w": t})
    assert state_hash({"x": t}) != base
    assert state_hash({"w": t.reshape(6, 4)}) != base
    swapped = t.clone()
    b = bits(swapped)
    b[0], b[1] = b[1].copy(), b[0].copy()
    if b[0] != b[1]:
        assert state_hash({"w": swapped}) != base


def test_incremental_equals_full_over_a_chain(rng):
    state = {"a": random_tensor(rng, "BF16", (200, 30)), "b": random_tensor(rng, "F32", (77,))}
    h = state_hash(state)
    receiver = {k: v.clone() for k, v in state.items()}
    for step in range(6):
        new = mutated(rng, state, 0.05)
        buf = io.BytesIO()
        write_delta(buf, state, new, base_version=step, base_hash=h, target_version=step + 1)
        h = apply_delta(DeltaFile(buf.getvalue()), receiver, base_hash=h)  # tracked, never recomputed
        assert h == state_hash(new) == state_hash(receiver)
        state = new


def test_wide_key_form_for_8_byte_dtypes():
    key = TensorKey("x", "F64", (4,), 8)
    assert not key.compact
    idx = np.arange(4)
    assert key.change(idx, np.zeros(4, np.uint64), np.ones(4, np.uint64)) != 0


def reference_hash(state: dict) -> str:
    """The hash exactly as statehash's docstring defines it, in plain Python integers."""
    import hashlib

    M = (1 << 64) - 1

    def mix(x):
        x &= M
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & M
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & M
        return x ^ (x >> 31)

    total = 0
    for name, t in state.items():
        b = bits(t)
        w = 8 * b.dtype.itemsize
        dtype = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64"}[t.dtype]
        salt = int.from_bytes(hashlib.sha256(f"{name}\0{dtype}\0{list(t.shape)}".encode()).digest()[:8], "little")
        total += mix(salt)
        for i, v in enumerate(b.tolist()):
            total += mix(salt + (i << w) + v) if w < 64 else mix(mix(salt + i) ^ v)
    return f"{total & M:016x}"


def test_hash_matches_its_definition(rng):
    state = {
        "a": random_tensor(rng, "BF16", (7, 9)),
        "b": random_tensor(rng, "F32", (5,)),
        "c": random_tensor(rng, "F64", (4,)),
    }
    assert state_hash(state) == reference_hash(state)
