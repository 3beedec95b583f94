"""The trainer vouches for every version: Ed25519 signatures that relays forward and cannot make.

What is signed (each statement starts with its own domain, so one kind never passes for another):
- each piece of a delta file (its header, each chunk, its tail): version, offset, length, sha256,
  and whether it ends the file. Pieces are signed one by one, as the trainer's server first lists
  them, so cut-through stays: a relay lists them in the order they reach it, and a worker checks
  each listed piece alone before it fetches a byte of it. Together they cover the file byte for
  byte, and so its header (the base it applies to) and its manifest (the target state hash).
- each base snapshot: version, state hash, size, part size and the sha256 of its parts.
- each finished delta's whole piece table, once: a worker that lists a finished delta from its
  start checks one signature instead of one per piece.

The key is derived from the job's secret, which only the trainer (and whoever starts it) holds;
relays and workers get the public key (`SPARROWRL_TRAINER_KEY`). A version of another job, an old
version under a new number, or bytes a relay changed do not verify.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

KEY_ENV = "SPARROWRL_TRAINER_KEY"
TOKEN_PREFIX = "sprl1."  # a role token (tokens.py); any other token is a job secret
_PIECE = b"sparrowrl/delta-piece/v1\0"
_BASE = b"sparrowrl/base/v1\0"
_TABLE = b"sparrowrl/delta-table/v1\0"
SIG_CHARS = 86  # an Ed25519 signature, base64url without padding


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def signing_key(secret: str) -> Ed25519PrivateKey:
    """The job's signing key: a function of its secret, so the trainer needs nothing else."""
    seed = hmac.new(secret.encode(), b"sparrowrl/signing-key/v1", hashlib.sha256).digest()
    return Ed25519PrivateKey.from_private_bytes(seed)


def public_text(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The public key as users pass it: `ed25519:` and base64url of its 32 bytes."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return "ed25519:" + b64(pub.public_bytes_raw())


def parse_public(text: str) -> Ed25519PublicKey:
    """ValueError naming what is wrong with a public key's text."""
    kind, _, body = text.strip().partition(":")
    if kind != "ed25519" or not body:
        raise ValueError(f"{KEY_ENV}: {text[:20]!r}… is not 'ed25519:' and a base64url key")
    try:
        raw = unb64(body)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"{KEY_ENV}: not 32 bytes of base64url after 'ed25519:'")
    return Ed25519PublicKey.from_public_bytes(raw)


def piece_statement(version: int, offset: int, length: int, sha256: str, final: bool) -> bytes:
    return _PIECE + struct.pack("<QQQ?", version, offset, length, final) + bytes.fromhex(sha256)


def table_statement(version: int, pieces: Sequence[Sequence[Any]]) -> bytes:
    """A finished delta's pieces ([offset, length, sha256, final, …] in file order), all at once."""
    table = hashlib.sha256(b"".join(struct.pack("<QQ?", o, n, f) + bytes.fromhex(h) for o, n, h, f, *_ in pieces))
    return _TABLE + struct.pack("<Q", version) + table.digest()


def base_statement(version: int, state_hash: str, size: int, part_bytes: int, parts: list[str]) -> bytes:
    listed = hashlib.sha256(b"".join(bytes.fromhex(h) for h in parts)).digest()
    return _BASE + struct.pack("<QQQ", version, size, part_bytes) + bytes.fromhex(state_hash) + listed


class Signer:
    """The trainer's side. Signing is deterministic: a restarted trainer signs a piece the same."""

    def __init__(self, secret: str):
        self.key = signing_key(secret)
        self.verifier = Verifier(self.key.public_key())

    def sign(self, statement: bytes) -> str:
        return b64(self.key.sign(statement))


class Verifier:
    """A relay's or a worker's side: whether a statement is the trainer's."""

    def __init__(self, public: Ed25519PublicKey):
        self.public = public

    def ok(self, statement: bytes, sig: str) -> bool:
        if len(sig) != SIG_CHARS:
            return False
        try:
            self.public.verify(unb64(sig), statement)
        except (InvalidSignature, ValueError):
            return False
        return True


def trust(token: str, key_text: str | None = None) -> Verifier | None:
    """Whose signatures a process accepts: the public key it was given (`SPARROWRL_TRAINER_KEY`
    by default), else the one its job secret derives (a trainer, or a tool given the secret).
    None without either: no token, an unauthenticated loopback setup, checks no signatures.
    ValueError for a role token without the public key: that process could check nothing."""
    key_text = os.environ.get(KEY_ENV) if key_text is None else key_text
    if key_text:
        return Verifier(parse_public(key_text))
    if token.startswith(TOKEN_PREFIX):
        raise ValueError(f"a role token needs the trainer's public key: set {KEY_ENV}")
    return Signer(token).verifier if token else None
