"""Test tensors: arbitrary bit patterns, states that change a fraction of their elements a version,
and bit-for-bit comparison (a codec must reproduce NaN payloads and -0.0, which `==` cannot see)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from sparrowrl.delta.bitview import DTYPES, bits
from sparrowrl.store.store import Store


def random_tensor(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Arbitrary bit patterns: NaN payloads, infinities, subnormals and -0.0 all occur."""
    t = torch.empty(shape, dtype=DTYPES[dtype][0])
    b = bits(t)
    b[:] = rng.integers(0, np.iinfo(b.dtype).max, size=b.shape, dtype=b.dtype, endpoint=True)
    if dtype == "BOOL":
        b &= 1
    return t


def mutate(rng: np.random.Generator, t: torch.Tensor, density: float) -> torch.Tensor:
    """Change about `density` of the elements: +-1 steps, sign flips and arbitrary new patterns."""
    out = t.clone()
    b = bits(out)
    n = b.shape[0]
    k = int(round(density * n))
    if k == 0:
        return out
    pos = rng.choice(n, size=k, replace=False)
    kind = rng.integers(0, 4, size=k)
    one = b.dtype.type(1)
    top = b.dtype.type(1 << (8 * b.dtype.itemsize - 1))
    v = b[pos]
    v = np.where(kind == 0, v + one, v)
    v = np.where(kind == 1, v - one, v)
    v = np.where(kind == 2, v ^ top, v)
    rand = rng.integers(0, np.iinfo(b.dtype).max, size=k, dtype=b.dtype, endpoint=True)
    v = np.where(kind == 3, rand, v)
    if t.dtype == torch.bool:
        v = (b[pos] ^ 1).astype(b.dtype)
    b[pos] = v
    return out


def mutated(rng: np.random.Generator, state: dict[str, torch.Tensor], density: float) -> dict[str, torch.Tensor]:
    """The next version of `state`: `density` of every tensor's elements changed (`mutate`)."""
    return {k: mutate(rng, t, density) for k, t in state.items()}


def layer(rng: np.random.Generator, rows: int, cols: int) -> dict[str, torch.Tensor]:
    """A policy's state in small: a bf16 weight `w` and an fp32 norm `n`, of arbitrary bits."""
    return {"w": random_tensor(rng, "BF16", (rows, cols)), "n": random_tensor(rng, "F32", (cols,))}


def versions(rng: np.random.Generator, first: dict, count: int, density: float) -> list[dict[str, torch.Tensor]]:
    """`first` and the `count` versions after it, each `mutated` from the one before."""
    states = [first]
    for _ in range(count):
        states.append(mutated(rng, states[-1], density))
    return states


def stored(path: Path, states: list[dict], base_every: int) -> Store:
    """A store at `path` that holds `states` as versions 0, 1, ...."""
    store = Store.init(path, states[0], base_every=base_every)
    for s in states[1:]:
        store.add(s)
    return store


def adam_step_pair(rng: np.random.Generator, n: int, lr: float = 1e-6, steps: int = 4):
    """bf16 before/after of an Adam-like step on fp32 master weights (a realistic delta)."""
    w = torch.from_numpy(rng.standard_normal(n, dtype=np.float32) * 0.02).bfloat16().float()
    m, v = torch.zeros(n), torch.zeros(n)
    drift = torch.from_numpy(rng.standard_normal(n, dtype=np.float32))
    for t in range(1, steps + 1):
        prev = w.bfloat16()
        g = 0.5 * drift + torch.from_numpy(rng.standard_normal(n, dtype=np.float32))
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        w = w - lr * (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-8)
    return prev, w.bfloat16()


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two states hold the same names and, in each, the same bits."""
    return set(a) == set(b) and all(np.array_equal(bits(a[k]), bits(b[k])) for k in a)


def bf16(source: torch.nn.Module | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The bf16 cast of a module's parameters (or of a state), made on the host apart from the code
    under test: what a rollout engine started from those weights holds."""
    named = source.named_parameters() if isinstance(source, torch.nn.Module) else source.items()
    return {n: p.detach().cpu().to(torch.bfloat16).clone() for n, p in named}
