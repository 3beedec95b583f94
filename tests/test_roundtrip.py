"""Bit-exact round trips over dtypes, shapes, densities and special values."""

import io

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.tensors import adam_step_pair, mutate, random_tensor

from sparrowrl.delta import DeltaFile, apply_delta, state_hash, write_delta
from sparrowrl.delta.bitview import bits

DTYPE_NAMES = ["BF16", "F16", "F32", "F64", "I8", "U8", "I16", "I32", "I64", "BOOL", "F8_E4M3", "F8_E5M2"]


def roundtrip(old: dict, new: dict, **kw) -> tuple[dict, dict]:
    buf = io.BytesIO()
    m = write_delta(buf, old, new, base_version=3, base_hash=state_hash(old), target_version=4, **kw)
    state = {k: v.clone() for k, v in old.items()}
    h = apply_delta(DeltaFile(buf.getvalue()), state, verify_full=True)
    for k in new:
        assert np.array_equal(bits(state[k]), bits(new[k])), k
    assert h == m["target_hash"] == state_hash(new)
    changed = sum(int((bits(old[k]) != bits(new[k])).sum()) for k in new)
    assert m["changed"] == changed
    return m, state


shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPE_NAMES),
    shape=shapes,
    density=st.one_of(st.just(0.0), st.just(1.0), st.floats(0, 1)),
    seed=st.integers(0, 2**32 - 1),
    segment=st.sampled_from([7, 64, 1 << 22]),
    chunk=st.sampled_from([1, 200, 1 << 22]),
)
def test_roundtrip_property(dtype, shape, density, seed, segment, chunk):
    rng = np.random.default_rng(seed)
    old = {"t": random_tensor(rng, dtype, shape), "other": random_tensor(rng, "BF16", (5,))}
    new = {"t": mutate(rng, old["t"], density), "other": old["other"].clone()}
    roundtrip(old, new, segment=segment, chunk_bytes=chunk)


SPECIAL_F32 = [0.0, -0.0, float("inf"), float("-inf"), 1e-45, -1e-45, 1e-40, 3.4e38, 1.0, -1.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_special_values_and_nan_payloads(dtype):
    base = torch.tensor(SPECIAL_F32 * 4, dtype=torch.float32).to(dtype)
    new = base.clone()
    b = bits(new)
    b[: len(SPECIAL_F32)] = b[: len(SPECIAL_F32)][::-1]  # every special value turns into another
    size = b.dtype.itemsize * 8
    nan_exp = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}[dtype]
    b[-4:] = [nan_exp | 1, nan_exp | 3, (nan_exp | 5) | (1 << (size - 1)), nan_exp | 0x40]  # distinct NaN payloads
    old = {"x": base}
    _, state = roundtrip(old, {"x": new})
    # NaN != NaN as floats, so compare patterns: payloads must survive exactly
    assert list(bits(state["x"])[-4:]) == list(b[-4:])


def test_sign_flips_and_zero_signs():
    x = torch.tensor([0.0, 1.5, -2.25, 1e-30, -0.0], dtype=torch.bfloat16)
    y = torch.tensor([-0.0, -1.5, 2.25, -1e-30, 0.0], dtype=torch.bfloat16)
    m, _ = roundtrip({"x": x}, {"x": y})
    assert m["changed"] == 5


def test_realistic_step_is_compact(rng):
    """A realistic ~1% step must stay far below dense and near the entropy of the changes."""
    old, new = adam_step_pair(rng, 1 << 21)
    m, _ = roundtrip({"w": old}, {"w": new})
    density = m["changed"] / m["elements"]
    assert 0.003 < density < 0.05
    assert m["file_bytes"] / m["changed"] < 1.45, m["file_bytes"] / m["changed"]


def test_dense_change_does_not_blow_up(rng):
    """Everything changed to random bits: the delta stays within a whisker of the dense size."""
    old = {"w": random_tensor(rng, "BF16", (1 << 16,))}
    new = {"w": random_tensor(rng, "BF16", (1 << 16,))}
    m, _ = roundtrip(old, new)
    assert m["file_bytes"] < 1.01 * m["dense_bytes"] + 1024


def test_unchanged_state_gives_empty_delta(rng):
    old = {"w": random_tensor(rng, "BF16", (1000,))}
    m, _ = roundtrip(old, {"w": old["w"].clone()})
    assert m["changed"] == 0 and m["chunks"] == []


def test_cpu_encoding_is_deterministic(rng):
    old = {"w": random_tensor(rng, "BF16", (50_000,))}
    new = {"w": mutate(rng, old["w"], 0.01)}
    outs = []
    for _ in range(2):
        buf = io.BytesIO()
        write_delta(buf, old, new, base_version=0, base_hash=state_hash(old), target_version=1, segment=4096)
        outs.append(buf.getvalue())
    assert outs[0] == outs[1]


def test_clustered_changes_with_huge_gaps(rng):
    """Bunched changes then a far one: the gap quotient escapes (q >= 255) must round-trip."""
    old = {"emb": random_tensor(rng, "BF16", (1 << 22,))}
    new = {"emb": old["emb"].clone()}
    b = bits(new["emb"])
    b[1000:2000] += 1  # a dense run: mean gap tiny, so k is 0
    b[3_000_000] += 1  # then one change three million elements further on
    b[(1 << 22) - 1] ^= 0x8000
    m, _ = roundtrip(old, new)
    assert m["changed"] == 1002


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), runs=st.integers(1, 6))
def test_clustered_property(seed, runs):
    """Runs of changes at random places (rows of an embedding, frozen blocks)."""
    rng = np.random.default_rng(seed)
    old = {"t": random_tensor(rng, "BF16", (300_000,))}
    new = {"t": old["t"].clone()}
    b = bits(new["t"])
    for _ in range(runs):
        s = int(rng.integers(0, 299_000))
        b[s : s + int(rng.integers(1, 1000))] += 1
    roundtrip(old, new, segment=1 << 17)
