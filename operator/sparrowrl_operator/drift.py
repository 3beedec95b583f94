"""Drift: where an object in a cluster differs from the manifest decided for it. What the server
or others add is no difference; a field this operator applied before and no longer decides is."""

from __future__ import annotations

from typing import Any

from sparrowrl_operator import builders
from sparrowrl_operator.constants import CORRECTED, MANAGER
from sparrowrl_operator.cycle import Facts, Outcome
from sparrowrl_operator.pods import Cluster


def unmet(want: Any, have: Any, path: str = "") -> str | None:
    """The first place where `have` lacks what `want` holds, or None: dicts key by key, each item
    of a list in some item of the observed list (another manager may add items; the server
    orders them), anything else equal. Empty maps and lists count as met: the API drops them."""
    if isinstance(want, (dict, list)) and not want:
        return None
    if isinstance(want, dict):
        if not isinstance(have, dict):
            return path or "."
        for k, v in want.items():
            if (hit := unmet(v, have.get(k), f"{path}.{k}" if path else k)) is not None:
                return hit
        return None
    if isinstance(want, list):
        if not isinstance(have, list):
            return path
        for i, v in enumerate(want):
            if all(unmet(v, h) is not None for h in have):
                return f"{path}[{i}]"
        return None
    return None if want == have else path


def applied_fields(obj: dict) -> dict:
    """The fields (managedFields' FieldsV1) that this operator's last apply set on `obj`."""
    out: dict = {}
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") == MANAGER and entry.get("operation") == "Apply":
            out = builders.merge(out, entry.get("fieldsV1") or {})
    return out


def dropped(fields: dict, want: dict, path: str = "") -> str | None:
    """A field applied before (FieldsV1: `f:name` keys; items of lists are not followed) that
    `want` no longer has: an apply removes it, so it is a difference too."""
    for key, sub in fields.items():
        if not key.startswith("f:"):
            continue
        name = key[2:]
        at = f"{path}.{name}" if path else name
        if name not in want:
            return at
        if isinstance(sub, dict) and isinstance(want[name], dict) and (hit := dropped(sub, want[name], at)):
            return hit
    return None


def drift(desired: dict, observed: dict) -> str | None:
    """Where the observed object differs from the manifest decided for it, or None. A Secret is
    compared as stored (data), and apiVersion and kind are left out (a list's items lack them)."""
    want = builders.stored(desired)
    body = {k: v for k, v in want.items() if k not in ("apiVersion", "kind")}
    return unmet(body, observed) or dropped(applied_fields(observed), want)


def ensure(c: Facts, out: Outcome, cluster: Cluster, manifest: dict, expected: bool = False) -> bool:
    """The object as decided: a missing one applied (an apply, not a create: one that lost its
    labels is missing from the lists, yet there), a drifted one applied again, with a Corrected
    Event unless the change is `expected`. Whether it existed."""
    kind, name = manifest["kind"], manifest["metadata"]["name"]
    seen = c.seen(cluster, kind, name)
    if seen is None:
        out.actions.apply.append((cluster, manifest))
    elif where := drift(manifest, seen):
        out.actions.apply.append((cluster, manifest))
        if not expected:
            out.event(
                CORRECTED,
                f"{kind} {name}" + (f" in cluster {cluster}" if cluster else "") + f": {where} differed from "
                "what the operator decides; applied it again",
            )
    return seen is not None
