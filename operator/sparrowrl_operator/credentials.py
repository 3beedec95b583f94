"""Relays' and worker slots' tokens: each expires an hour after it is minted and is minted anew
when half of that is left, in the slot's Secret, which its pods read again where they run; each
carries its slot's generation, a new one for each pod the slot is given (the seconds of the
clock when it is made), so that a replaced pod's token is refused once its successor calls in.
An operator away for half an hour leaves every token valid; clocks may differ by
`tokens.SKEW` (five minutes)."""

from __future__ import annotations

import base64
import binascii
import functools

from sparrowrl.auth.signing import Signer, Verifier
from sparrowrl.auth.tokens import MAX_CLAIM, Claims, verified
from sparrowrl.spec.layout import Process
from sparrowrl_operator import builders
from sparrowrl_operator.builders import JobRef
from sparrowrl_operator.constants import CA_KEY, TOKEN_GENERATION_ANNOTATION, TOKEN_KEY
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
    """What the token in the slot's Secret says, if the job's key signed it (a Secret in a member
    cluster is in others' hands: nothing in it is taken on its word)."""
    seen = c.seen(cluster, "Secret", builders.credentials_name(job, role))
    token = secret_value(seen, TOKEN_KEY) if seen is not None else None
    return _verified(c.obs.token, token.decode(errors="replace")) if token else None


@functools.lru_cache(maxsize=1 << 15)
def _verified(secret: str, token: str) -> Claims | None:
    """Checked once per token (an Ed25519 check, for each of a job's thousands of slots a cycle)."""
    return verified(token, _verifier(secret))


@functools.lru_cache(maxsize=64)
def _verifier(secret: str) -> Verifier:
    return Signer(secret).verifier


def held_ca(c: Facts, cluster: Cluster, job: JobRef, role: Process) -> bytes | None:
    """The CA certificate the slot's Secret gives its pods now."""
    seen = c.seen(cluster, "Secret", builders.credentials_name(job, role))
    return secret_value(seen, CA_KEY) if seen is not None else None


def next_generation(c: Facts, now_held: Claims | None, current: int | None) -> int:
    """The generation of a slot's next pod: the Secret's when no pod has had it yet (its pod's
    creation failed; `current`: the slot's pod's, None without one), else later than any before."""
    g = now_held.generation if now_held else None
    if g is not None and (current is None or g > current):
        return g
    return max(int(c.obs.now.timestamp()), g + 1 if g is not None and g + 1 < MAX_CLAIM else 0)


def own_generation(pod: dict) -> int | None:
    """A pod's generation, as noted on it when it was made; None: a pod from before generations,
    or a note that is not one (-1)."""
    note = ((pod.get("metadata") or {}).get("annotations") or {}).get(TOKEN_GENERATION_ANNOTATION)
    if note is None:
        return None
    try:
        return int(note) if 0 <= int(note) < MAX_CLAIM else -1
    except (TypeError, ValueError):
        return -1


def generation_of(c: Facts, pod: dict, now_held: Claims | None) -> int | None:
    """The generation the slot's Secret keeps for its running pod: the pod's own, or one the
    Secret holds already that is higher (handed out to a pod about to be made): never a lower
    one, which servers that saw the higher would refuse. A note that is not a generation (edited)
    gets a new one, which the pod reads from its Secret; no note (a pod from before generations):
    the Secret's, if any."""
    own, g = own_generation(pod), now_held.generation if now_held else None
    if own == -1:
        return next_generation(c, now_held, None) if g is None else max(g, int(c.obs.now.timestamp()))
    if own is None:
        return g
    return max(own, g) if g is not None else own


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
        and LIFETIME * REFRESH < now_held.expires - now <= LIFETIME
    ):
        expires = now_held.expires  # the same token: signing is deterministic
    secret = builders.credentials_secret(job, role, c.obs.token, namespace, home, ca, expires, generation)
    renewed = now_held is not None and (now_held.generation, now_held.expires) != (generation, expires)
    ensure(c, out, cluster, secret, expected=renewed)  # anything else that differs was edited: Corrected
