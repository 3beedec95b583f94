"""Relays' and worker slots' tokens: each expires an hour after it is minted and is minted anew
when half of that is left, in the slot's Secret, which its pods read again where they run; each
carries its slot's generation, a new one for each pod the slot is given (the seconds of the
clock when it is made), so that a replaced pod's token is refused once its successor calls in.
An operator away for half an hour leaves every token valid; clocks may differ by
`tokens.SKEW` (five minutes)."""

from __future__ import annotations

import base64
import binascii

from sparrowrl.auth.tokens import Claims, claims
from sparrowrl.spec.layout import Process
from sparrowrl_operator import builders
from sparrowrl_operator.builders import JobRef
from sparrowrl_operator.constants import TOKEN_GENERATION_ANNOTATION, TOKEN_KEY
from sparrowrl_operator.cycle import Facts, Outcome
from sparrowrl_operator.drift import ensure
from sparrowrl_operator.pods import Cluster

LIFETIME = 3600  # seconds a token is valid from when it is minted
REFRESH = 0.5  # of LIFETIME left when it is minted anew


def secret_value(obj: dict, key: str) -> bytes | None:
    """A Secret's value, from `data` (as an API server stores it) or `stringData` (as written)."""
    if (value := (obj.get("data") or {}).get(key)) is not None:
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            return None
    value = (obj.get("stringData") or {}).get(key)
    return value.encode() if isinstance(value, str) else None


def held(c: Facts, cluster: Cluster, job: JobRef, role: Process) -> Claims | None:
    """What the token in the slot's Secret says, if there is one of ours."""
    seen = c.seen(cluster, "Secret", builders.credentials_name(job, role))
    token = secret_value(seen, TOKEN_KEY) if seen is not None else None
    return claims(token.decode(errors="replace")) if token else None


def next_generation(c: Facts, now_held: Claims | None) -> int:
    """The generation of a slot's next pod: later than any before it."""
    return max(int(c.obs.now.timestamp()), (now_held.generation or 0) + 1 if now_held else 0)


def generation_of(pod: dict, now_held: Claims | None) -> int | None:
    """The generation of a slot's pod: its annotation (a pod from before generations: the Secret's)."""
    try:
        return int(pod["metadata"]["annotations"][TOKEN_GENERATION_ANNOTATION])
    except (KeyError, TypeError, ValueError):
        return now_held.generation if now_held else None


def keep(
    c: Facts,
    out: Outcome,
    cluster: Cluster,
    role: Process,
    namespace: str,
    ca: bytes | None,
    generation: int | None,
    now_held: Claims | None,
) -> None:
    """The slot's Secret, with a token of `generation` that has at least half its life left, and
    the CA certificate its pods trust (`ca`, when the job is encrypted)."""
    home = cluster is None
    job = c.job if home else c.job.in_member()
    now = int(c.obs.now.timestamp())
    expires = now + LIFETIME
    if (
        now_held is not None
        and now_held.generation == generation
        and now_held.expires is not None
        and now_held.expires - now > LIFETIME * REFRESH
    ):
        expires = now_held.expires  # the same token: signing is deterministic
    secret = builders.credentials_secret(job, role, c.obs.token, namespace, home, ca, expires, generation)
    renewed = now_held is not None and (now_held.generation, now_held.expires) != (generation, expires)
    ensure(c, out, cluster, secret, expected=renewed)  # anything else that differs was edited: Corrected
