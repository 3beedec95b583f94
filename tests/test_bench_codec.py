"""hack/bench_codec.py measures the field's formats beside SparrowRL's: the references it measures
must round-trip what they claim to, and its JSON must hold every format on every scenario."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sparrowrl.delta.bitview import bits

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "hack"))
import bench_codec  # noqa: E402
import peer_formats  # noqa: E402
from support.tensors import mutate, random_tensor

EXACT = [p for p, exact in peer_formats.BIT_EXACT.items() if exact]


@pytest.mark.parametrize("fmt", EXACT)
def test_exact_peers_round_trip_any_bits(rng, fmt):
    """Arbitrary bit patterns (NaN payloads, infinities, -0.0), first and last elements changed,
    a tensor with no change, 1-D, 2-D and 4-D shapes, bf16 and fp32."""
    old = {
        "emb": random_tensor(rng, "BF16", (300, 70)),
        "norm": random_tensor(rng, "BF16", (70,)),
        "conv": random_tensor(rng, "BF16", (4, 3, 9, 5)),
        "still": random_tensor(rng, "BF16", (64,)),
        "master": random_tensor(rng, "F32", (40, 33)),
    }
    new = {k: t if k == "still" else mutate(rng, t, 0.05) for k, t in old.items()}
    for k in ("emb", "conv"):
        bits(new[k])[[0, -1]] ^= 1
    encode, decode_apply = peer_formats.FORMATS[fmt]
    state = {k: t.clone() for k, t in old.items()}
    decode_apply(encode(old, new), state)
    for k in new:
        assert np.array_equal(bits(state[k]), bits(new[k])), k


def test_additive_deltas_are_not_exact():
    """The published additive format rounds twice: a 1-ULP step of a large weight whose
    difference is exact, and a change whose difference bf16 cannot hold, which comes out wrong."""
    old = {"w": torch.tensor([1.0, 256.0, 1.0], dtype=torch.bfloat16)}
    new = {"w": torch.tensor([1.0078125, 258.0, 1.0], dtype=torch.bfloat16)}
    new["w"][2] = 3.0e-3  # 1.0 -> 0.003: the difference -0.997 is rounded to bf16
    encode, decode_apply = peer_formats.FORMATS["additive-bf16"]
    state = {"w": old["w"].clone()}
    decode_apply(encode(old, new), state)
    assert state["w"][:2].tolist() == new["w"][:2].tolist()
    assert state["w"][2].item() != new["w"][2].item()


@pytest.mark.timeout(300)
def test_bench_json_holds_every_format(tmp_path):
    out = tmp_path / "bench.json"
    bench_codec.main(["--tiny", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["mode"] == "tiny"
    assert set(result["peers"]) == set(peer_formats.FORMATS)
    names = [r["scenario"] for r in result["scenarios"]]
    assert names[:3] == ["synthetic-lr1e-06", "synthetic-lr1e-05", "tiny-qwen3 (1 step)"], names
    wrong = 0
    for row in result["scenarios"]:
        formats = {"v1": row["v1"], "v3": row["v3"]} | row["peers"]
        assert set(formats) == {"v1", "v3", *peer_formats.FORMATS}
        for f, m in formats.items():
            assert math.isfinite(m["bytes_per_changed"]) and m["bytes_per_changed"] > 0, (row["scenario"], f)
        assert row["bit_exact"], row["scenario"]
        for p, m in row["peers"].items():
            if peer_formats.BIT_EXACT[p]:  # every element's bits compared with the new state's
                assert m["bit_exact"] and m["wrong"] == 0, (row["scenario"], p)
        wrong += row["peers"]["additive-bf16"]["wrong"]
        if row["scenario"].startswith("synthetic"):  # timed: every format beside memcpy
            for f, m in formats.items():
                for k in ("diff_encode", "decode_apply"):
                    assert m[f"{k}_GBps"] > 0 and m[f"{k}_vs_memcpy"] > 0, (row["scenario"], f, k)
    assert wrong > 0, "the additive format came out exact on every step: the comparison saw nothing"
