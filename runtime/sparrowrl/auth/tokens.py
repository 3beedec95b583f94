"""Credentials per role. The job's secret stays with the trainer (and whoever starts it: the
local runner, the operator); every other process gets a token for its role and name, signed with
the job's key (signing.py), so any process holding the public key can check it:

    admin        the secret itself, or a token minted for "admin": everything
    worker NAME  read versions, the job and the model; lease, submit and commit as NAME only
                 (NAME `P-*`: as P-0, P-1, …, the attempts of one pod slot in a cluster)
    relay NAME   read versions only

Nothing publishes over HTTP: versions come from the trainer's own store, signed with its key.

A token may carry an expiry (`exp`, Unix seconds), after which it is refused, give or take SKEW
for clocks that differ between clusters; and a generation (`gen`): once a server has seen a
token of a name at one generation, it refuses that name's tokens of any lower one, so the token
of a pod that was replaced stops working when its successor calls in. The operator mints both;
`sparrowrl run` and tokens minted by hand carry neither, and last as long as the job's key.
"""

from __future__ import annotations

import hmac
import json
import time
from dataclasses import dataclass
from typing import Literal

from sparrowrl.auth.signing import KEY_ENV, TOKEN_PREFIX, Signer, Verifier, b64, public_text, unb64

Role = Literal["admin", "worker", "relay"]
ROLES: tuple[Role, ...] = ("admin", "worker", "relay")
_TOKEN = b"sparrowrl/token/v1\0"
MAX_TOKEN = 1024  # bytes of an Authorization header worth checking
MAX_CACHED = 4096  # tokens whose check is remembered (a check is an Ed25519 verify, ~70 us)
MAX_NAMES = 1 << 16  # names whose newest generation a server remembers: a job's slots, many times over
SKEW = 300  # seconds a token is still taken past its expiry: clocks of two clusters may differ this much
MAX_CLAIM = 2**53  # expiries and generations are integers JSON carries exactly
READ = ("/v1/versions", "/v1/plan")  # the store's endpoints, and what lies below them
JOB = ("/v1/job", "/v1/model")
CONTROL = ("/v1/work", "/v1/results", "/v1/commit")


@dataclass(frozen=True)
class Principal:
    role: Role
    name: str


ADMIN = Principal("admin", "")


@dataclass(frozen=True)
class Claims:
    """What a token says, its signature checked or not (`claims`)."""

    who: Principal
    expires: int | None = None  # Unix seconds
    generation: int | None = None


def mint(signer: Signer, role: Role, name: str, expires: int | None = None, generation: int | None = None) -> str:
    """A token for `role` under `name` (a worker's name, a relay's region), refused after
    `expires` (Unix seconds) and once a higher `generation` of `name` has been seen."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
    body: dict[str, object] = {"role": role, "name": name}
    for key, value in (("exp", expires), ("gen", generation)):
        if value is not None:
            if not 0 <= value < MAX_CLAIM:
                raise ValueError(f"{key} {value}: out of range")
            body[key] = value
    claims = b64(json.dumps(body, separators=(",", ":")).encode())
    return f"{TOKEN_PREFIX}{claims}.{signer.sign(_TOKEN + claims.encode())}"


def verified(token: str, verifier: Verifier) -> Claims | None:
    """What a role token says, if the job's key signed it; else None."""
    if not token.startswith(TOKEN_PREFIX):
        return None
    signed, _, sig = token[len(TOKEN_PREFIX) :].partition(".")
    if not verifier.ok(_TOKEN + signed.encode(errors="surrogateescape"), sig):
        return None
    return claims(token)


def claims(token: str) -> Claims | None:
    """What a role token says, its signature unchecked (`verified` checks it), or None."""
    if not token.startswith(TOKEN_PREFIX):
        return None
    try:
        c = json.loads(unb64(token[len(TOKEN_PREFIX) :].partition(".")[0]))
        who = Principal(c["role"], c["name"])
        exp, gen = c.get("exp"), c.get("gen")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if who.role not in ROLES or not isinstance(who.name, str):
        return None
    for v in (exp, gen):
        if v is not None and (type(v) is not int or not 0 <= v < MAX_CLAIM):
            return None
    return Claims(who, exp, gen)


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

    def __init__(self, secret: str | None, verifier: Verifier | None, skew: float = SKEW):
        self.secret, self.verifier, self.skew = secret, verifier, skew
        self._seen: dict[str, Claims | None] = {}
        self._newest: dict[str, int] = {}  # name → the highest generation of its tokens seen

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
        who = self.check(header)
        return who if isinstance(who, Principal) else None

    def check(self, header: str, now: float | None = None) -> Principal | str:
        """Who the header's token names, or why it names no one."""
        token = header.removeprefix("Bearer ") if header.startswith("Bearer ") else ""
        if not token or len(token) > MAX_TOKEN:
            return "missing or wrong bearer token"
        if self.secret is not None and hmac.compare_digest(
            token.encode(errors="surrogateescape"), self.secret.encode()
        ):
            return ADMIN
        if token not in self._seen:
            if len(self._seen) >= MAX_CACHED:
                self._seen.clear()
            self._seen[token] = self._check(token)
        c = self._seen[token]
        if c is None:
            return "missing or wrong bearer token"
        if c.expires is not None and (now if now is not None else time.time()) > c.expires + self.skew:
            return f"the token expired at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(c.expires))}"
        if c.generation is None and c.who.name in self._newest:  # from before its name's generations
            return f"the token has no generation, and its name's is {self._newest[c.who.name]}"
        if c.generation is not None:
            newest = self._newest.get(c.who.name, -1)
            if c.generation < newest:
                return f"the token of generation {c.generation} was replaced by generation {newest}"
            if c.generation > newest:
                if c.who.name not in self._newest and len(self._newest) >= MAX_NAMES:
                    del self._newest[next(iter(self._newest))]  # the oldest name first
                self._newest[c.who.name] = c.generation
        return c.who

    def _check(self, token: str) -> Claims | None:
        return verified(token, self.verifier) if self.verifier is not None else None
