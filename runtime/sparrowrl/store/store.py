"""The checkpoint store: storage and transfer are the same object.

    STORE/store.json                     index: every version, its state hash, its files
    STORE/bases/v00000000.safetensors    a full snapshot every `base_every` versions
    STORE/deltas/v00000001-<sha>.spd     the immutable delta (v-1 -> v), named by content hash

Any version materializes as (nearest base) + (delta chain); a holder of version u reaches v by
whichever route is fewer bytes: replaying u+1..v, or a base b <= v plus b+1..v.

`prune(keep)` drops what comes before the base that serves the oldest of the newest `keep`
versions: the newest version stays materializable whatever `keep` is. Who calls it decides what
is still needed: a relay keeps its newest `--keep` versions, the trainer keeps what a live
worker, a restart or an export can still ask for (trainer/retention.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from sparrowrl.delta import DeltaFile, DeltaWriter, apply_delta, state_hash
from sparrowrl.delta.bitview import bits
from sparrowrl.delta.errors import DeltaError
from sparrowrl.delta.statehash import format_hash, tensor_hash, tensor_key
from sparrowrl.delta.tensors import TensorSpec
from sparrowrl.store.changes import Telling, tell
from sparrowrl.store.checkpoint_io import Checkpoint, CheckpointError, atomic_path, save_stream
from sparrowrl.store.index import FORMAT, MAX_BASE_EVERY, Version, check_index, part_bytes

_FILE = re.compile(r"v[0-9]{8}[-.]")  # a delta's or a base's name


class StoreError(Exception):
    """The store is missing, damaged, or cannot serve the request."""


@dataclass
class Stream:
    """A state that arrives one tensor at a time, in the order of `specs` (a sharded trainer's
    gathered tensors): a snapshot of it never holds the whole model."""

    specs: list[TensorSpec]
    tensors: Iterable[tuple[str, torch.Tensor]]


State = Mapping[str, torch.Tensor] | Stream


@dataclass
class Route:
    """How to reach `target` from `have` (None: from nothing)."""

    have: int | None
    target: int
    route: str  # "none", "chain" or "base"
    base: int | None
    deltas: list[int] = field(default_factory=list)
    bytes: int = 0


class Store:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._load()

    def _load(self) -> None:
        """Read the index (again: another writer may have changed it)."""
        index = self.path / "store.json"
        if not index.is_file():
            raise StoreError(f"{self.path}: not a sparrowrl store (no store.json)")
        try:
            raw = json.loads(index.read_text())
            if not isinstance(raw, dict) or raw.get("format") != FORMAT:
                raise StoreError(f"{index}: unsupported store format {raw.get('format')}")
            self.base_every = raw["base_every"]
            self.versions = {v["version"]: Version(**v) for v in raw["versions"]}
            check_index(self.base_every, self.versions, len(raw["versions"]))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise StoreError(f"{index}: damaged index ({e})") from None

    # ---- creation and writing ----
    @classmethod
    def init(cls, path: str | Path, base: State, base_every: int = 10, version: int = 0) -> Store:
        path = Path(path)
        if (path / "store.json").exists():
            raise StoreError(f"{path}: a store already exists here")
        if not 1 <= base_every <= MAX_BASE_EVERY:
            raise StoreError(f"base_every must be 1..{MAX_BASE_EVERY:,}, got {base_every}")
        (path / "bases").mkdir(parents=True, exist_ok=True)
        (path / "deltas").mkdir(exist_ok=True)
        v = Version(version, "0" * 16)
        cls._write_base(path, version, base, v, None)
        cls._write_index(path, base_every, {version: v})
        return cls(path)

    @staticmethod
    def _write_base(path: Path, version: int, state: State, v: Version, expect: str | None) -> None:
        """Write the snapshot and set `v`'s base fields; its state hash is computed as it is
        written, and must be `expect` when given (else it becomes `v`'s)."""
        v.base = f"v{version:08d}.safetensors"
        f = path / "bases" / v.base
        specs, tensors = (
            (state.specs, state.tensors)
            if isinstance(state, Stream)
            else ([TensorSpec.of(n, t) for n, t in state.items()], state.items())
        )
        total = 0

        def hashed():
            nonlocal total
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                for name, t in tensors:
                    total += tensor_hash(tensor_key(name, t), bits(t.cpu()), pool)
                    yield name, t

        def verify() -> None:
            if expect is not None and format_hash(total) != expect:
                raise StoreError(f"snapshot of v{version}: state hashes to {format_hash(total)}, not {expect}")

        save_stream(specs, hashed(), f, verify)
        v.state_hash = format_hash(total) if expect is None else expect
        v.base_bytes = f.stat().st_size
        v.base_part_bytes = part_bytes(v.base_bytes)
        with open(f, "rb") as fh:
            v.base_parts = [
                hashlib.sha256(block).hexdigest() for block in iter(lambda: fh.read(v.base_part_bytes), b"")
            ]

    @classmethod
    def mirror(cls, path: str | Path, base_every: int, version: int, state_hash: str) -> Store:
        """An empty mirror of another store (a relay's), starting at `version`: an index with
        that one entry and no files yet. `record` adds what arrives."""
        if not 1 <= base_every <= MAX_BASE_EVERY:
            raise StoreError(f"base_every must be 1..{MAX_BASE_EVERY:,}, got {base_every}")
        path = Path(path)
        (path / "bases").mkdir(parents=True, exist_ok=True)
        (path / "deltas").mkdir(exist_ok=True)
        cls._write_index(path, base_every, {version: Version(version, state_hash)})
        return cls(path)

    def record(self, *entries: Version) -> None:
        """Add or replace index entries for files a mirror has put in place (a delta under its
        content-hashed name), or will fetch on request (a base: `base` names it before the file
        is here). The index never names a delta that is not here."""
        with self._locked():
            for v in entries:
                if v.delta and not (self.path / "deltas" / v.delta).is_file():
                    raise StoreError(f"v{v.version}: delta {v.delta} is not in the store")
                self.versions[v.version] = v
            try:
                check_index(self.base_every, self.versions, len(self.versions))
            except ValueError as e:
                self._load()  # the index on disk is untouched
                raise StoreError(f"refused index entry: {e}") from None
            self._save_index()

    def _save_index(self) -> None:
        self._write_index(self.path, self.base_every, self.versions)
        self._tell()

    def _tell(self) -> None:
        tell(self.path)

    @staticmethod
    def _write_index(path: Path, base_every: int, versions: dict[int, Version]) -> None:
        data = {"format": FORMAT, "base_every": base_every, "versions": [asdict(versions[k]) for k in sorted(versions)]}
        with atomic_path(path / "store.json") as tmp:
            tmp.write_text(json.dumps(data, indent=1))

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """One writer at a time; the index is re-read under the lock."""
        with open(self.path / ".lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            self._load()
            yield

    @property
    def newest(self) -> int:
        return max(self.versions)

    def base_due(self, version: int) -> bool:
        """Whether `version` gets a base snapshot (every `base_every` versions)."""
        return version % self.base_every == 0

    def drop_partial(self) -> None:
        """Remove the delta a writer was writing when it died (the store's own file): its readers
        would wait for it forever. Only the next writer calls this, before writing."""
        with self._locked():
            for v in self.producing():
                self.partial_path(v).unlink(missing_ok=True)
            for p in (self.path / "deltas").glob(".v*.sealing"):
                p.unlink()
        self._tell()

    def partial_path(self, version: int) -> Path:
        """Where the delta of `version` grows while it is being written (cut-through source)."""
        return self.path / "deltas" / f".v{version:08d}.partial"

    def tensor_table(self) -> dict[str, TensorSpec]:
        """The tensors every version has: those of the oldest base snapshot (the store's first
        version always has one, also after pruning)."""
        oldest = self.versions[min(self.versions)]
        try:
            if oldest.base is None:  # caught below, as a base that cannot be read
                raise TypeError("it has no base snapshot")
            with Checkpoint(self.path / "bases" / oldest.base) as ck:
                return {t.name: t for t in ck.specs}
        except (CheckpointError, TypeError) as e:
            raise StoreError(f"base v{oldest.version} cannot be read for its tensor table ({e})") from None

    def producing(self) -> list[int]:
        """Versions whose delta is being written right now."""
        return sorted(
            v
            for v in (int(p.name[2:10]) for p in (self.path / "deltas").glob(".v*.partial") if p.name[2:10].isdigit())
            if v > self.newest
        )

    def add(self, new: dict[str, torch.Tensor]) -> Version:
        """Append `new` as the next version, diffed against the newest (materialized and verified)."""
        specs = [TensorSpec.of(n, t) for n, t in new.items()]
        with self._locked():
            _same_tensors(self.tensor_table(), {t.name: t for t in specs}, self.newest)  # before the long work
            old = self.materialize(self.newest)
            with self._publish(specs) as w:
                w.add((n, old[n], new[n]) for n in new)
            v = self.versions[self.newest]
            if self.base_due(v.version):
                self._write_base(self.path, v.version, new, v, v.state_hash)
                self._save_index()
            return v

    @contextmanager
    def publish(self, tensors: list[TensorSpec], cut_through: bool = True) -> Iterator[DeltaWriter]:
        """Stream the next version's delta into the store while it is being encoded: its chunks
        can be served (cut-through) before the last tensor is diffed. The caller adds every
        tensor as (name, old, new), old being the newest version's state; on leaving the block
        the delta is sealed, content-hashed and indexed. A base snapshot, when one is due, is the
        caller's to write with `snapshot`. Without `cut_through` the delta is written where no
        reader looks and appears once sealed (store-and-forward, what the benchmarks compare)."""
        with self._locked(), self._publish(tensors, cut_through) as w:
            yield w

    @contextmanager
    def _publish(self, tensors: list[TensorSpec], cut_through: bool = True) -> Iterator[DeltaWriter]:
        prev = self.versions[self.newest]
        version = prev.version + 1
        _same_tensors(self.tensor_table(), {t.name: t for t in tensors}, prev.version)
        tmp_path = self.partial_path(version) if cut_through else self.path / "deltas" / f".v{version:08d}.sealing"
        try:
            with open(tmp_path, "wb") as f:
                w = DeltaWriter(
                    Telling(f, self._tell) if cut_through else f,
                    tensors,
                    base_version=prev.version,
                    base_hash=prev.state_hash,
                    target_version=version,
                )
                try:
                    yield w
                finally:
                    w.encoder.close()
                m = w.close()
            digest = _sha256_file(tmp_path)
            name = f"v{version:08d}-{digest[:16]}.spd"
            os.replace(tmp_path, self.path / "deltas" / name)
        finally:
            tmp_path.unlink(missing_ok=True)
        self.versions[version] = Version(version, m["target_hash"], name, digest, m["file_bytes"], changed=m["changed"])
        self._save_index()

    def snapshot(self, version: int, state: State) -> None:
        """Write a base snapshot of `version` (whose state is `state`), checked against its hash."""
        with self._locked():
            v = self.versions[version]
            self._write_base(self.path, version, state, v, v.state_hash)
            self._save_index()

    # ---- reading ----
    def delta(self, version: int) -> DeltaFile:
        v = self.versions[version]
        if v.delta is None:
            raise StoreError(f"version {version} has no delta")
        try:
            data = (self.path / "deltas" / v.delta).read_bytes()
        except OSError as e:
            raise StoreError(f"delta v{version} cannot be read ({e.strerror}: {v.delta})") from None
        if hashlib.sha256(data).hexdigest() != v.delta_sha256:
            raise StoreError(f"delta v{version} ({v.delta}) does not match its content hash")
        return DeltaFile(data, f"delta v{version}")

    def _chain_ok(self, start: int, end: int) -> bool:
        return all(self.versions.get(x) is not None and self.versions[x].delta for x in range(start + 1, end + 1))

    def plan(self, have: int | None, target: int) -> Route:
        """The cheapest route, in bytes, from version `have` to `target`."""
        if target not in self.versions:
            raise StoreError(f"version {target} is not in the store (has {self._span()})")
        if have == target:
            return Route(have, target, "none", None)
        options: list[Route] = []
        if have is not None and have in self.versions and have < target and self._chain_ok(have, target):
            ds = list(range(have + 1, target + 1))
            options.append(Route(have, target, "chain", None, ds, sum(self.versions[d].delta_bytes for d in ds)))
        for b, vb in self.versions.items():
            if vb.base and b <= target and self._chain_ok(b, target):
                ds = list(range(b + 1, target + 1))
                options.append(
                    Route(have, target, "base", b, ds, vb.base_bytes + sum(self.versions[d].delta_bytes for d in ds))
                )
        if not options:
            raise StoreError(f"no route to version {target}: no base at or before it with a full delta chain")
        return min(options, key=lambda p: (p.bytes, p.route != "chain"))

    def materialize(
        self, target: int, have: tuple[int, dict[str, torch.Tensor], str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Version `target` in memory, every step hash-checked; the base is verified in full."""
        p = self.plan(have[0] if have else None, target)
        if p.route == "none":
            assert have is not None  # the route from a version to itself
            return have[1]
        if p.route == "base":
            base = self.versions[p.base].base if p.base is not None else None
            assert p.base is not None and base is not None  # a base route names a version with a base (plan)
            with Checkpoint(self.path / "bases" / base) as ck:
                state = ck.load()
            h = state_hash(state)
            if h != self.versions[p.base].state_hash:
                raise StoreError(f"base v{p.base} hashes to {h}, index says {self.versions[p.base].state_hash}")
        else:
            assert have is not None  # a chain starts at what the caller holds (plan)
            state, h = have[1], have[2]
        for d in p.deltas:
            try:
                h = apply_delta(self.delta(d), state, base_hash=h)
            except DeltaError as e:
                raise StoreError(f"replaying delta v{d}: {e}") from None
            if h != self.versions[d].state_hash:
                raise StoreError(f"v{d} hashes to {h}, index says {self.versions[d].state_hash}")
        return state

    def prune(self, keep: int) -> list[int]:
        """Keep the newest `keep` versions reachable: drop everything before the newest base that
        serves the oldest kept version. Returns the versions whose files were removed; with
        nothing to remove, the index is not rewritten (its readers are not woken)."""
        if keep < 1:
            raise StoreError("keep must be at least 1")
        with self._locked():
            oldest = self.newest - keep + 1
            bases = [b for b, v in self.versions.items() if v.base and b <= oldest and self._chain_ok(b, oldest)]
            if not bases:
                return []
            floor = max(bases)
            removed, doomed = [], []
            for x in sorted(self.versions):
                v = self.versions[x]
                if x < floor:
                    doomed += [self.path / sub / f for sub, f in (("deltas", v.delta), ("bases", v.base)) if f]
                    del self.versions[x]
                    removed.append(x)
                elif x == floor and v.delta:
                    doomed.append(self.path / "deltas" / v.delta)
                    v.delta, v.delta_sha256, v.delta_bytes = None, None, 0
            # files an earlier prune unlisted, then was killed before it removed them
            doomed += [f for f in self._files() if int(f.name[1:9]) < floor and f not in doomed]
            if not removed and not doomed:
                return []
            self._save_index()  # index first: never names a missing file
            for f in doomed:
                f.unlink(missing_ok=True)
            return removed

    def _files(self) -> list[Path]:
        """The version files in the store's folders (not those being written: their names start with a dot)."""
        return [f for sub in ("deltas", "bases") for f in (self.path / sub).iterdir() if _FILE.match(f.name)]

    def _span(self) -> str:
        return f"v{min(self.versions)}..v{self.newest}"


def _same_tensors(have: dict[str, TensorSpec], new: dict[str, TensorSpec], v: int) -> None:
    """A new version has exactly the store's tensors: one with a tensor missing would be stored
    as unchanged there, and no later version could be replayed onto it."""
    for name in sorted(have.keys() | new.keys()):
        a, b = have.get(name), new.get(name)
        if a is None:
            raise StoreError(
                f"the new version has tensor '{name}', which v{v} does not (a new version must have "
                f"exactly the same tensors)"
            )
        if b is None:
            raise StoreError(
                f"the new version lacks tensor '{name}', which v{v} has (a new version must have "
                f"exactly the same tensors)"
            )
        if a != b:
            raise StoreError(
                f"tensor '{name}' is {b.dtype}{list(b.shape)} in the new version, {a.dtype}{list(a.shape)} in v{v}"
            )


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
