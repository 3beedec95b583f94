"""Times as the API server writes them (metav1.Time: RFC 3339, seconds, UTC)."""

from __future__ import annotations

import datetime


def stamp(t: datetime.datetime) -> str:
    return t.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def since(t: str | None, now: datetime.datetime) -> float:
    """Seconds from `t` to `now`; 0 when there is no `t` yet."""
    if not t:
        return 0.0
    return (now - datetime.datetime.fromisoformat(t.replace("Z", "+00:00"))).total_seconds()
