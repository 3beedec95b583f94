"""Credentials per role. The job's secret stays with the trainer (and whoever starts it: the
local runner, the operator); every other process gets a token for its role and name, signed with
the job's key (signing.py), so any process holding the public key can check it:

    admin        the secret itself, or a token minted for "admin": everything
    worker NAME  read versions, the job and the model; lease, submit and commit as NAME only
                 (NAME `P-*`: as P-0, P-1, …, the attempts of one pod slot in a cluster)
    relay NAME   read versions only

Nothing publishes over HTTP: versions come from the trainer's own store, signed with its key.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import Literal

from sparrowrl.auth.signing import KEY_ENV, TOKEN_PREFIX, Signer, Verifier, b64, public_text, unb64

Role = Literal["admin", "worker", "relay"]
ROLES: tuple[Role, ...] = ("admin", "worker", "relay")
_TOKEN = b"sparrowrl/token/v1\0"
MAX_TOKEN = 1024  # bytes of an Authorization header worth checking
MAX_CACHED = 4096  # tokens whose check is remembered (a check is an Ed25519 verify, ~70 us)
READ = ("/v1/versions", "/v1/plan")  # the store's endpoints, and what lies below them
JOB = ("/v1/job", "/v1/model")
CONTROL = ("/v1/work", "/v1/results", "/v1/commit")


@dataclass(frozen=True)
class Principal:
    role: Role
    name: str


ADMIN = Principal("admin", "")


def mint(signer: Signer, role: Role, name: str) -> str:
    """A token for `role` under `name` (a worker's name, a relay's region)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
    claims = b64(json.dumps({"role": role, "name": name}, separators=(",", ":")).encode())
    return f"{TOKEN_PREFIX}{claims}.{signer.sign(_TOKEN + claims.encode())}"


def acts_as(who: Principal, worker: str) -> bool:
    """Whether `who` may lease, submit and commit under the worker name `worker`."""
    if who.role == "admin":
        return True
    if who.role != "worker":
        return False
    if who.name.endswith("-*"):
        stem = who.name[:-1]
        return worker.startswith(stem) and worker[len(stem) :].isdigit()
    return worker == who.name


def environment(secret: str, kind: Role | Literal["trainer"], name: str) -> dict[str, str]:
    """What a process of the job gets: the trainer, the secret; a relay (named by its region) or
    a worker, its own token and the trainer's public key."""
    if kind == "trainer":
        return {"SPARROWRL_TOKEN": secret}
    signer = Signer(secret)
    return {"SPARROWRL_TOKEN": mint(signer, kind, name), KEY_ENV: public_text(signer.key)}


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def allowed(who: Principal, method: str, path: str) -> str | None:
    """Why `who` may not make this request, or None if it may."""
    if who.role == "admin":
        return None
    if _under(path, READ) and method in ("GET", "HEAD"):
        return None
    if who.role == "worker" and (_under(path, JOB) and method in ("GET", "HEAD") or path in CONTROL):
        return None  # whose name a control request acts under is checked against the body (control.py)
    return f"a {who.role}'s token may not {method} {path}" + (
        " (relays read versions only)" if who.role == "relay" else ""
    )


class Gate:
    """Who a request's bearer token names, or None: the job secret (on the trainer), or a role
    token that the trainer's key signed."""

    def __init__(self, secret: str | None, verifier: Verifier | None):
        self.secret, self.verifier = secret, verifier
        self._seen: dict[str, Principal | None] = {}

    @classmethod
    def of(cls, token: str, verifier: Verifier | None) -> Gate | None:
        """A server's gate from its own token: a job secret checks both kinds; a role token
        (a relay's) checks role tokens with `verifier`. None without a token: open."""
        if not token:
            return None
        if token.startswith(TOKEN_PREFIX):
            if verifier is None:
                raise ValueError("a server with a role token needs the trainer's public key to check its clients")
            return cls(None, verifier)
        return cls(token, verifier or Signer(token).verifier)

    def principal(self, header: str) -> Principal | None:
        token = header.removeprefix("Bearer ") if header.startswith("Bearer ") else ""
        if not token or len(token) > MAX_TOKEN:
            return None
        if self.secret is not None and hmac.compare_digest(
            token.encode(errors="surrogateescape"), self.secret.encode()
        ):
            return ADMIN
        if token not in self._seen:
            if len(self._seen) >= MAX_CACHED:
                self._seen.clear()
            self._seen[token] = self._check(token)
        return self._seen[token]

    def _check(self, token: str) -> Principal | None:
        if self.verifier is None or not token.startswith(TOKEN_PREFIX):
            return None
        claims, _, sig = token[len(TOKEN_PREFIX) :].partition(".")
        if not self.verifier.ok(_TOKEN + claims.encode(errors="surrogateescape"), sig):
            return None
        try:
            c = json.loads(unb64(claims))
            who = Principal(c["role"], c["name"])
        except (ValueError, KeyError, TypeError):
            return None
        return who if who.role in ROLES and isinstance(who.name, str) else None
