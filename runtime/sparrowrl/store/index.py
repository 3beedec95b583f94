"""The store's index (store.json): one entry per version, and the check that reads it as untrusted,
since a relay's mirror writes entries that came over the network."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

FORMAT = 1
BASE_PART = 8 << 20  # bases are verified (and fetched, and resumed) in parts of this size at most
MIN_BASE_PART = 64 << 10
BASE_PARTS = 64  # a base smaller than this many parts of BASE_PART is cut finer: every stream gets work
MAX_BASE_EVERY = 1_000_000
_HEX16, _HEX64 = re.compile(r"[0-9a-f]{16}"), re.compile(r"[0-9a-f]{64}")
_SIG = re.compile(r"([A-Za-z0-9_-]{86})?")


@dataclass
class Version:
    version: int
    state_hash: str
    delta: str | None = None  # file name under deltas/
    delta_sha256: str | None = None
    delta_bytes: int = 0
    base: str | None = None  # file name under bases/
    base_bytes: int = 0
    base_parts: list[str] = field(default_factory=list)  # sha256 of each base_part_bytes piece
    base_part_bytes: int = BASE_PART  # a power of two, MIN_BASE_PART..BASE_PART (`part_bytes`)
    changed: int = 0
    # the trainer's signatures, as a relay's mirror got them (the trainer signs as it serves)
    base_sig: str = ""
    delta_sigs: list[str] = field(default_factory=list)  # one per piece of the delta file, in file order
    delta_table_sig: str = ""  # of all its pieces at once


def check_index(base_every: object, versions: dict, listed: int) -> None:
    """An index is read as untrusted: every file it names must lie inside the store, under the
    name the store gives it, and every number must be in range (ValueError names the entry)."""
    if type(base_every) is not int or not 1 <= base_every <= MAX_BASE_EVERY:
        raise ValueError(f"base_every {base_every!r} is not 1..{MAX_BASE_EVERY:,}")
    if not versions or len(versions) != listed:
        raise ValueError("no versions" if not versions else "a version is listed twice")
    for k, v in versions.items():
        where = f"version {k!r}"
        if type(k) is not int or not 0 <= k < 10**8:
            raise ValueError(f"{where}: not a version number (0..99999999)")
        if not isinstance(v.state_hash, str) or not _HEX16.fullmatch(v.state_hash):
            raise ValueError(f"{where}: state_hash {v.state_hash!r} is not 16 hex digits")
        for n in ("delta_bytes", "base_bytes", "changed"):
            if type(getattr(v, n)) is not int or not 0 <= getattr(v, n) < 1 << 62:
                raise ValueError(f"{where}: {n} {getattr(v, n)!r} is not a count")
        if v.delta is not None and (
            not isinstance(v.delta_sha256, str)
            or not _HEX64.fullmatch(v.delta_sha256)
            or v.delta != f"v{k:08d}-{v.delta_sha256[:16]}.spd"
        ):
            raise ValueError(f"{where}: delta {v.delta!r} is not the store's name for its content hash")
        if v.base is not None and (
            v.base != f"v{k:08d}.safetensors"
            or not isinstance(v.base_parts, list)
            or not all(isinstance(h, str) and _HEX64.fullmatch(h) for h in v.base_parts)
            or not _part_size(v.base_part_bytes)
            or len(v.base_parts) != -(-v.base_bytes // v.base_part_bytes)
        ):
            raise ValueError(f"{where}: base {v.base!r} is not the store's name, or its parts do not fit its size")
        if not (
            isinstance(v.base_sig, str)
            and _SIG.fullmatch(v.base_sig)
            and isinstance(v.delta_sigs, list)
            and isinstance(v.delta_table_sig, str)
            and _SIG.fullmatch(v.delta_table_sig)
            and all(isinstance(x, str) and _SIG.fullmatch(x) for x in v.delta_sigs)
        ):
            raise ValueError(f"{where}: a signature is not base64url of 64 bytes")


def part_bytes(size: int) -> int:
    """The part size of a base of `size` bytes: BASE_PART, or for a base of fewer than BASE_PARTS
    such parts, the power of two that cuts it into about BASE_PARTS (MIN_BASE_PART at least)."""
    return max(MIN_BASE_PART, min(BASE_PART, 1 << max(0, -(-size // BASE_PARTS) - 1).bit_length()))


def _part_size(n: object) -> bool:
    return type(n) is int and MIN_BASE_PART <= n <= BASE_PART and n & (n - 1) == 0
