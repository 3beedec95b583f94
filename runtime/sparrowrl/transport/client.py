"""Pull versions from a server or relay: the version listing, the server's plan, and the pieces
that make a delta or a base, each checked against what the trainer signed before a byte of it is
fetched. The pieces travel over parallel streams (streams.py) from the first server that answers
(failover.py); a server whose answer does not verify is refused, and the next one asked, in the
end the origin. On FetchError nothing the caller holds has been touched."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from typing import Literal

import aiohttp
import torch

from sparrowrl.auth.credential import Credential
from sparrowrl.auth.signing import Verifier, base_statement, piece_statement, table_statement
from sparrowrl.auth.signing import trust as trust_of
from sparrowrl.delta import DeltaError, DeltaFile, apply_delta, state_hash
from sparrowrl.spec.limits import memory_available
from sparrowrl.store.checkpoint_io import CheckpointError, tensors_in
from sparrowrl.transport.answers import Listing, PieceList, Plan
from sparrowrl.transport.failover import PORT_WAIT_S, FetchError, Refused, Servers
from sparrowrl.transport.streams import Keep, Piece, Place, pull


async def _leads(plan: dict, have: tuple | None, target: int) -> None:
    """A plan leads from what the caller holds to `target`, one delta after another: the signed
    versions it names then decide the result, and a server cannot pass off another version."""
    route, base, deltas = plan["route"], plan["base"], plan["deltas"]
    if route != "base" and have is None:
        raise Refused(f"route {route!r} to v{target} for a client that holds nothing")
    start = {"none": target, "chain": have[0] if have else None, "base": base}[route]
    if start is None or start > target or len(deltas) != target - start or deltas != list(range(start + 1, target + 1)):
        raise Refused(
            f"route {route!r} (base {base}, {len(deltas)} deltas) does not lead from "
            f"{'nothing' if have is None else f'v{have[0]}'} to v{target}"
        )


class Client:
    """The fetches of versions from an ordered list of equivalent servers (relays first, origin
    last), through one `Servers` (its connection pools, retries and fallback)."""

    def __init__(
        self,
        urls: list[str] | str,
        token: str | Credential | None = None,
        streams: int = 4,
        attempts: int = 8,
        backoff: float = 0.2,
        group_bytes: int = 64 << 20,
        ssl_context: ssl.SSLContext | None = None,
        read_timeout: float = 30.0,
        local_ports: list[int] | None = None,
        rate_mbit: float | None = None,
        port_wait: float = PORT_WAIT_S,
        trust: Verifier | None | Literal["env"] = "env",
    ):
        """`local_ports`: bind download stream i to local port local_ports[i] (one connection each),
        for networks that shape per flow (hack/wan classifies flows by port). A stream whose port
        is taken (another process's connection, or its own not yet closed) waits for it, up to
        `port_wait` seconds per request, without counting that as failed attempts. `rate_mbit`:
        cap the download rate of all streams together (a token bucket), to emulate a slow link.
        `token`: by default SPARROWRL_TOKEN, or SPARROWRL_TOKEN_FILE's (read again when it changes).
        `trust`: whose signatures versions must carry; by default `signing.trust` of the token
        (ValueError for a role token without SPARROWRL_TRAINER_KEY)."""
        credential = Credential.of(token)
        self.trust = trust_of(credential.get()) if isinstance(trust, str) else trust  # "env"
        self.servers = Servers(
            [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)],
            credential,
            attempts,
            backoff,
            ssl_context,
            read_timeout,
            local_ports,
            rate_mbit,
            port_wait,
        )
        self.streams, self.group_bytes, self.stats = streams, group_bytes, self.servers.stats
        # one request's answer, retried and sent to the next server as `Servers` does
        self.json, self.content, self.post_json = self.servers.json, self.servers.content, self.servers.post_json

    @property
    def server_url(self) -> str:
        """The URL of the server in use (where the last request went, unless it failed over since)."""
        return self.servers.urls[self.servers.server]

    async def __aenter__(self) -> "Client":
        self.servers.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.servers.close()

    async def versions(
        self, after: int | None = None, wait: float = 0.0, base: int | None = None, delta: int | None = None
    ) -> dict:
        """The version list; with `after`, returns once a newer version exists or `wait` passes;
        with `base`, once that version's base snapshot is listed; with `delta`, once that version
        is stored (its delta hashed and indexed)."""
        params = {k: x for k, x in (("after", after), ("base", base), ("delta", delta)) if x is not None}
        if not params:
            return await self.json("/v1/versions", Listing, check=self._bases_signed)
        # the server may hold the answer for `wait` seconds: that is not a stalled read
        timeout = aiohttp.ClientTimeout(
            total=None, connect=10, sock_read=(self.servers.timeout.sock_read or 0.0) + wait
        )
        return await self.json(
            "/v1/versions", Listing, check=self._bases_signed, params={**params, "wait": wait}, timeout=timeout
        )

    async def _bases_signed(self, listing: dict) -> None:
        """Every base a listing offers carries the trainer's signature of its parts and state hash."""
        trust = self.trust
        if trust is None:
            return
        bases = [(e["version"], e["state_hash"], e["base"]) for e in listing["versions"] if e["base"]]

        def bad() -> str | None:
            for v, h, b in bases:
                sig = b.get("sig", "")
                if not trust.ok(base_statement(v, h, b["bytes"], b["part_bytes"], b["parts"]), sig):
                    return f"base v{v}: " + ("unsigned" if not sig else "its signature is not the trainer's")
            return None

        if why := await asyncio.to_thread(bad):
            raise Refused(why)

    async def download(self, path: str, size: int, pieces: list[Piece]) -> bytearray:
        """The file at `path` (`size` bytes), fetched as verified pieces over parallel streams."""
        buf = bytearray(size)
        view = memoryview(buf)

        async def source() -> AsyncIterator[list[Piece]]:
            yield pieces

        await self._pull(path, source(), lambda p: view[p.offset : p.offset + p.length], lambda p, data: None)
        return buf

    async def _pull(self, path: str, source: AsyncIterator[list[Piece]], place: Place, keep: Keep) -> None:
        """`streams.pull` with this client's streams and group size; with the trainer's key, the
        digests are signed, and a relay whose bytes fail one is refused."""
        await pull(self.servers, path, source, place, keep, self.streams, self.group_bytes, self.trust is not None)

    async def _listed(
        self, path: str, done: dict, version: int | None = None, expect: dict[int, Piece] | None = None
    ) -> AsyncIterator[list[Piece]]:
        """The pieces that `path` (a pieces endpoint) lists as ready, batch by batch, each once,
        until it says the file is complete; `done["bytes"]` is then the file's size. Long-polls
        while the file grows. A list in another order (another server, or a relay's list in
        arrival order giving way to file order) is read anew from its start. With `version`
        (a delta's) and `trust`, each piece must carry the trainer's signature, and a complete
        list must cover the file up to its signed end (`_signed`). With `expect` (a base's parts,
        as its signed listing gives them), the list may name those only, and all of them once
        complete."""
        after, epoch = 0, None
        listed: set[int] = set()
        covered: dict[int, tuple[int, bool]] = {}  # offset → (length, final) of the pieces listed so far

        async def check(t: dict) -> None:
            if expect is not None:
                if any(expect.get(p[0]) != Piece(p[0], p[1], p[2], p[3]) for p in t["pieces"]):
                    raise Refused(f"{path}: parts that the version listing does not list")
                if (
                    t["complete"]
                    and (t["epoch"] == epoch or after == 0)
                    and len({*listed, *(p[0] for p in t["pieces"])}) != len(expect)
                ):  # (another order: read anew)
                    raise Refused(f"{path}: complete without every part the version listing lists")
            if version is not None and self.trust is not None:  # a list in another order is read anew below
                whole = t["epoch"] == epoch or after == 0
                if len(t["pieces"]) > 2 and not t.get("table_sig"):  # a thread's hop costs about one check
                    await asyncio.to_thread(self._signed, version, t, covered, whole)
                else:
                    self._signed(version, t, covered, whole)

        while True:
            t = await self.json(path, PieceList, check=check, params={"after": after, "wait": 10})
            if t["epoch"] != epoch:
                epoch, fresh = t["epoch"], after == 0
                after = 0
                if not fresh:
                    continue
            after += len(t["pieces"])
            covered.update((p[0], (p[1], p[3])) for p in t["pieces"])
            new = [Piece(*p) for p in t["pieces"] if p[0] not in listed]
            listed.update(p.offset for p in new)
            yield new
            if t["complete"]:
                done["bytes"] = t["bytes"]
                return

    def _signed(self, version: int, t: dict, covered: dict[int, tuple[int, bool]], whole: bool) -> None:
        """A delta's piece list verifies: each piece signed for this version (or a whole table at
        once), and once complete (`whole`: a list to be read on from `covered`), pieces from 0 to
        the signed final piece's end, which is the file's size."""
        trust = self.trust
        assert trust is not None  # checked only with a key (`pieces`)
        if table := t.get("table_sig"):
            if not trust.ok(table_statement(version, t["pieces"]), table):
                raise Refused(f"delta v{version}: its piece table's signature is not the trainer's for this version")
        for offset, length, sha256, final, sig in [] if table else t["pieces"]:
            if not trust.ok(piece_statement(version, offset, length, sha256, final), sig):
                raise Refused(
                    f"delta v{version}: piece at {offset}: "
                    + ("unsigned" if not sig else "its signature is not the trainer's for this version")
                )
        if t["complete"] and whole:
            pieces = {**covered, **{p[0]: (p[1], p[3]) for p in t["pieces"]}}
            ends = [o + n for o, (n, final) in pieces.items() if final]
            pos = 0
            while pos in pieces:
                pos += pieces[pos][0]
            if ends != [t["bytes"]] or pos != t["bytes"]:
                raise Refused(
                    f"delta v{version}: the list says complete at {t['bytes']} bytes, but its pieces "
                    f"reach {pos} and end {ends or 'nowhere'}"
                )

    async def table_sig(self, version: int) -> str:
        """The trainer's signature of stored delta `version`'s whole piece table, checked where
        this client holds the key ("" where the server sends none): a relay keeps it for its
        workers, who then check a stored delta's list with one signature."""
        t = await self.json(f"/v1/versions/{version}/pieces", PieceList, params={"after": 0})
        sig = t.get("table_sig", "") if t["complete"] else ""
        return sig if self.trust is None or self.trust.ok(table_statement(version, t["pieces"]), sig) else ""

    async def delta(self, version: int, on_piece: Keep | None = None) -> DeltaFile:
        """One delta, staged in memory and fully verified; the caller applies it when it likes.

        Multi-stream cut-through: its pieces are fetched in parallel as soon as the server lists
        them, also while the delta is still being written; `on_piece(offset, bytes)` receives
        each piece as soon as it has verified, in whatever order they land. The whole file is
        then verified: a file of signed pieces that does not parse (pieces of two attempts at v,
        by a trainer restarted mid-write) refuses its server, and, without `on_piece`, is fetched
        again from the next."""
        got: dict[int, memoryview] = {}
        info: dict = {}
        room = 0

        def keep(p: Piece, data: memoryview) -> None:
            nonlocal room
            room -= len(data)
            if room < 0:
                raise FetchError(f"delta v{version}: the server's pieces take more than the memory free here")
            got[p.offset] = data
            if on_piece is not None:
                on_piece(p, data)

        while True:
            got.clear()
            room = memory_available() // 2  # pieces, then joined: a server that lists pieces without end must
            # not grow us until we are killed
            await self._pull(
                f"/v1/versions/{version}/delta",
                self._listed(f"/v1/versions/{version}/pieces", info, version),
                lambda p: memoryview(bytearray(p.length)),
                keep,
            )
            data = b"".join(got[k] for k in sorted(got))
            if len(data) != info.get("bytes"):
                raise FetchError(
                    f"delta v{version}: pieces cover {len(data)} bytes, the server listed {info.get('bytes')}"
                )
            try:
                return DeltaFile(data, f"delta v{version}")
            except DeltaError as e:
                if on_piece is not None:  # its pieces are passed on already
                    raise FetchError(f"delta v{version}: {e}") from None
                self.servers.refuse(self.servers.server, f"delta v{version}: {e}")

    async def base_parts(self, version: int, entry: dict, keep: Keep, place: Place | None = None) -> None:
        """A base snapshot's parts, each verified against the version listing `entry`, handed
        to `keep(piece, buffer)` as they land, each read into `place(piece)` (see `_pull`; by
        default a buffer of its own). Cut-through from a relay that is still fetching the base
        itself: parts are asked for only once the server lists them as ready."""
        size, step = entry["base"]["bytes"], entry["base"]["part_bytes"]
        n = len(entry["base"]["parts"])
        parts = {
            i * step: Piece(i * step, min(step, size - i * step), h, i == n - 1, "")
            for i, h in enumerate(entry["base"]["parts"])
        }
        place = place or (lambda p: memoryview(bytearray(p.length)))

        await self._pull(
            f"/v1/versions/{version}/base",
            self._listed(f"/v1/versions/{version}/base/pieces", {}, expect=parts),
            place,
            keep,
        )

    async def base(self, version: int, listing: dict) -> tuple[dict[str, torch.Tensor], str]:
        """A base snapshot, verified part by part and then by its full state hash."""
        entry = next((v for v in listing["versions"] if v["version"] == version and v["base"]), None)
        if entry is None:
            raise FetchError(f"the plan names base v{version}, which the version listing does not hold")
        size, free = entry["base"]["bytes"], memory_available()
        if size > free:
            raise FetchError(f"base v{version} is {size:,} bytes, more than the {free:,} bytes of memory free here")
        buf, got = bytearray(size), set()
        view = memoryview(buf)
        await self.base_parts(
            version, entry, lambda p, data: got.add(p.offset), lambda p: view[p.offset : p.offset + p.length]
        )
        if len(got) != len(entry["base"]["parts"]):
            raise FetchError(f"base v{version}: {len(got)} of {len(entry['base']['parts'])} parts arrived")
        try:
            state = tensors_in(buf)
        except CheckpointError as e:
            raise FetchError(f"base v{version}: {e}") from None
        h = await asyncio.to_thread(state_hash, state)
        if h != entry["state_hash"]:
            raise FetchError(f"base v{version} hashes to {h}, the listing says {entry['state_hash']}")
        return state, h

    async def plan(self, target: int, have: int | None = None) -> dict:
        """The server's cheapest route from version `have` (None: nothing held) to `target`:
        `route` ("none", "chain" or "base"), `base`, `deltas`; checked to lead there."""
        params = {"to": target} if have is None else {"to": target, "from": have}
        held = None if have is None else (have,)
        return await self.json("/v1/plan", Plan, check=lambda p: _leads(p, held, target), params=params)

    async def advance(
        self, target: int, have: tuple[int, dict[str, torch.Tensor], str] | None = None
    ) -> tuple[dict[str, torch.Tensor], str]:
        """Reach `target` by the server's cheapest plan; returns (state, state hash).

        `have` is (version, state, state hash) of what the caller holds; on the chain route its
        state is updated in place, and only after each delta has fully verified."""
        plan = await self.plan(target, None if have is None else have[0])
        listing = await self.versions()
        if plan["route"] == "none":
            assert have is not None  # _leads refuses any route but a base's to a client that holds nothing
            return have[1], have[2]
        if plan["route"] == "base":
            state, h = await self.base(plan["base"], listing)
        else:
            assert have is not None  # (_leads)
            state, h = have[1], have[2]
        for v in plan["deltas"]:
            h = apply_delta(await self.delta(v), state, base_hash=h)
        want = next((v["state_hash"] for v in listing["versions"] if v["version"] == target), None)
        if h != want and self.trust is None:  # with the key, the signed chain is what decides
            raise FetchError(f"v{target} hashes to {h}, the listing says {want}")
        return state, h
