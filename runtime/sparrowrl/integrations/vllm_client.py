"""The trainer's side of a `vllm serve` server that runs the sparrowrl backend: bring it to a
published version through vLLM's weight-update routes (dev mode). Only the standard library: a
trainer needs no vLLM to call it."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

MAX_WAIT_S = 600.0  # the longest a server waits for a version to arrive (the backend's bound too)


def _post(url: str, body: dict | None, timeout: float) -> None:
    req = urllib.request.Request(
        url, data=json.dumps(body or {}).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read()[:2000].decode(errors='replace')}") from None


def update_server(base_url: str, version: int, wait_s: float = 60.0) -> None:
    """Bring one server to `version`: requests in flight finish on the weights they started
    with (`/pause?mode=wait`), then its backend applies v, verified, and vLLM records it as the
    version it serves (`/weight_info`). On failure the server keeps what it served, is resumed,
    and RuntimeError carries the server's answer. `wait_s`: how long the server may wait for v
    to arrive from its origin or relay."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version: {version!r}, where a version number >= 0 is expected")
    if not isinstance(wait_s, int | float) or not math.isfinite(wait_s) or not 0 < wait_s <= MAX_WAIT_S:
        raise ValueError(f"wait_s: {wait_s!r} seconds, where (0, {MAX_WAIT_S:g}] are allowed")
    base = base_url.rstrip("/")
    timeout = wait_s + 60  # the update waits up to wait_s, then applies, loads and hashes
    _post(f"{base}/pause?mode=wait", None, timeout)
    try:
        _post(f"{base}/start_weight_update", None, timeout)
        _post(f"{base}/update_weights", {"update_info": {"version": version, "wait_s": wait_s}}, timeout)
        _post(f"{base}/finish_weight_update", {"weight_version": str(version)}, timeout)
        _post(f"{base}/reset_prefix_cache", None, timeout)
    finally:
        _post(f"{base}/resume", None, timeout)
