#!/usr/bin/env python3
"""Emulated WAN regions for transfer benchmarks: network namespaces + veth, shaped with htb.

Developer tool, Python 3.11 stdlib only; needs root, `ip` and `tc` (iproute2). See README.md
next to this file for the topology, the addresses and the port scheme.

    from wan import Wan, flow_port
    with Wan(regions=["us", "eu"], link_mbit=200, per_flow_mbit=50) as wan:
        server = wan.popen("origin", ["python3", "-m", "http.server", "8000"])
        wan.run("eu", ["curl", "--local-port", str(flow_port(0)), f"http://{wan.addr('origin')}:8000/"])

CLI:
    python3 hack/wan/wan.py selftest          # 2 regions, 200 Mbit/s link, 50 Mbit/s per flow
    python3 hack/wan/wan.py cleanup [--all]   # remove leftovers named sprl-*
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import re
import secrets
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

PREFIX = "sprl-"
ORIGIN = "origin"

# Per-flow classes: a flow is classified by its *client* port, which must lie in
# [FLOW_PORT_BASE, FLOW_PORT_BASE + FLOW_PORT_SPAN). The class is the port's low bits:
# class = port % flow_classes (flow_classes is a power of two, at most 256). Ports outside the
# range (servers, ephemeral client ports) share one default class. Servers must not listen on a
# port inside the range.
FLOW_PORT_BASE = 40960  # 0xA000
FLOW_PORT_SPAN = 256  # 40960 .. 41215

_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")
_ORIGIN_IF = "wan{}"  # origin's end of the link to region i (inside the origin namespace)
_REGION_IF = "wan"  # the region's end (inside the region namespace)


def flow_port(i: int) -> int:
    """The i-th client port of the flow range (0 <= i < 256); its class is i % flow_classes."""
    if not 0 <= i < FLOW_PORT_SPAN:
        raise ValueError(f"flow port index {i} outside 0..{FLOW_PORT_SPAN - 1}")
    return FLOW_PORT_BASE + i


def flow_class(port: int, flow_classes: int = 16) -> int | None:
    """The per-flow class a client port lands in, or None for the shared default class."""
    if not FLOW_PORT_BASE <= port < FLOW_PORT_BASE + FLOW_PORT_SPAN:
        return None
    return port % flow_classes


@dataclasses.dataclass(frozen=True)
class Region:
    """A region; link_mbit / per_flow_mbit override the Wan-wide values for its WAN link."""

    name: str
    link_mbit: float | None = None
    per_flow_mbit: float | None = None


def _sh(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(argv), capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _kbit(mbit: float) -> str:
    return f"{max(1, round(mbit * 1000))}kbit"


class Wan:
    """Builds the namespaces on enter (or `up()`), removes everything on exit (or `down()`).

    Topology (one namespace per site, all processes of a site share it):
      origin            10.77.0.1 (on lo; used as source towards every region)
      region i (0-based) 10.77.<i+1>.1, plus hosts 10.77.<i+1>.<10+k> for k < hosts_per_region
      WAN link i: veth origin:wan<i> 10.77.<i+1>.254/24 <-> region:wan 10.77.<i+1>.1/24,
                  htb on the egress of both ends (download and upload shaped alike)
    Region-to-region traffic is routed through the origin (two WAN links). Traffic between
    processes of one region stays on that namespace's loopback: unshaped.
    """

    def __init__(
        self,
        regions: Sequence[str | Region],
        link_mbit: float | None = None,
        per_flow_mbit: float | None = None,
        *,
        flow_classes: int = 16,
        hosts_per_region: int = 0,
        queue_ms: float = 50.0,
        prefix: str | None = None,
        handle_signals: bool = True,
    ) -> None:
        regs = [r if isinstance(r, Region) else Region(r) for r in regions]
        if not regs:
            raise ValueError("need at least one region")
        if len(regs) > 250:
            raise ValueError("at most 250 regions")
        names = [r.name for r in regs]
        for n in names:
            if not _NAME_RE.match(n) or n == ORIGIN:
                raise ValueError(f"bad region name {n!r}: [a-z][a-z0-9]{{0,11}}, not {ORIGIN!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate region names: {names}")
        if flow_classes < 1 or flow_classes > FLOW_PORT_SPAN or flow_classes & (flow_classes - 1):
            raise ValueError("flow_classes must be a power of two in 1..256")
        if not 0 <= hosts_per_region <= 200:
            raise ValueError("hosts_per_region must be in 0..200")
        self._regions = [
            Region(
                r.name,
                r.link_mbit if r.link_mbit is not None else link_mbit,
                r.per_flow_mbit if r.per_flow_mbit is not None else per_flow_mbit,
            )
            for r in regs
        ]
        for r in self._regions:
            if r.per_flow_mbit is not None and r.link_mbit is None:
                raise ValueError(f"region {r.name}: per_flow_mbit needs link_mbit")
        self.flow_classes = flow_classes
        self.hosts_per_region = hosts_per_region
        self.queue_ms = queue_ms
        self.prefix = prefix or f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}-"
        if not self.prefix.startswith(PREFIX):
            raise ValueError(f"prefix must start with {PREFIX!r}")
        self._handle_signals = handle_signals
        self._created: list[str] = []  # full netns names, in creation order
        self._procs: list[subprocess.Popen[Any]] = []
        self._old_handlers: dict[int, Any] = {}
        self._state = "new"  # new -> up -> down
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ queries

    @property
    def regions(self) -> list[str]:
        return [r.name for r in self._regions]

    @property
    def sites(self) -> list[str]:
        """All namespace keys: 'origin' and the region names."""
        return [ORIGIN, *self.regions]

    def netns(self, ns: str) -> str:
        """Full namespace name (for `ip netns exec` / `ip -n`)."""
        if ns not in self.sites:
            raise KeyError(f"unknown namespace {ns!r}; have {self.sites}")
        return f"{self.prefix}{ns}"

    def addr(self, ns: str, host: int | None = None) -> str:
        """IPv4 address of a site; `host=k` gives the k-th extra address of a region."""
        if ns == ORIGIN:
            if host is not None:
                raise ValueError("origin has no host addresses")
            return "10.77.0.1"
        i = self._index(ns)
        if host is None:
            return f"10.77.{i + 1}.1"
        if not 0 <= host < self.hosts_per_region:
            raise ValueError(f"host {host} outside 0..{self.hosts_per_region - 1}")
        return f"10.77.{i + 1}.{10 + host}"

    def flow_port(self, i: int) -> int:
        return flow_port(i)

    def link(self, region: str) -> Region:
        """The effective link settings of a region."""
        return self._regions[self._index(region)]

    def tc_stats(self, region: str) -> str:
        """`tc -s class show` of both ends of a region's WAN link (for debugging)."""
        i = self._index(region)
        out = []
        for ns, dev in ((ORIGIN, _ORIGIN_IF.format(i)), (region, _REGION_IF)):
            res = _sh(["tc", "-n", self.netns(ns), "-s", "class", "show", "dev", dev], check=False)
            out.append(f"== {ns}:{dev}\n{res.stdout}")
        return "\n".join(out)

    def _index(self, region: str) -> int:
        for i, r in enumerate(self._regions):
            if r.name == region:
                return i
        raise KeyError(f"unknown region {region!r}; have {self.regions}")

    # ------------------------------------------------------------------ processes

    def cmd(self, ns: str, argv: Sequence[str]) -> list[str]:
        """argv prefixed to run inside a namespace."""
        return ["ip", "netns", "exec", self.netns(ns), *map(str, argv)]

    def popen(self, ns: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """subprocess.Popen inside a namespace; killed (process group) on teardown.

        start_new_session defaults to True, so a terminal's Ctrl-C reaches only this script,
        which then stops the children in order.
        """
        if self._state != "up":
            raise RuntimeError("Wan is not up")
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.cmd(ns, argv), **kw)
        self._procs.append(p)
        return p

    def run(self, ns: str, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        """subprocess.run inside a namespace (same keywords, check defaults to False)."""
        if self._state != "up":
            raise RuntimeError("Wan is not up")
        return subprocess.run(self.cmd(ns, argv), **kw)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Wan:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> Wan:
        if self._state != "new":
            raise RuntimeError(f"Wan already {self._state}")
        if os.geteuid() != 0:
            raise PermissionError("Wan needs root (network namespaces, tc)")
        self._state = "up"
        atexit.register(self.down)
        self._install_signals()
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stop the processes started here, then delete links and namespaces. Idempotent."""
        with self._lock:
            if self._state == "down":
                return
            self._state = "down"
        try:
            self._stop_procs()
            for ns in reversed(self._created):
                _kill_netns_pids(ns)
            for i in range(len(self._regions)):
                if f"{self.prefix}{ORIGIN}" in self._created:
                    _sh(["ip", "-n", f"{self.prefix}{ORIGIN}", "link", "del", _ORIGIN_IF.format(i)], check=False)
            for ns in reversed(self._created):
                _del_netns(ns)
            self._created.clear()
        finally:
            self._restore_signals()
            atexit.unregister(self.down)

    def _stop_procs(self) -> None:
        live = [p for p in self._procs if p.poll() is None]
        for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
            for p in live:
                try:
                    os.killpg(p.pid, sig)  # start_new_session: pgid == pid
                except (ProcessLookupError, PermissionError):
                    try:
                        p.send_signal(sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + grace
            for p in live:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            live = [p for p in live if p.poll() is None]
            if not live:
                break

    def _install_signals(self) -> None:
        if not self._handle_signals or threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, _frame: object) -> None:
            if self._state != "up":  # tearing down: let it finish
                return
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old = signal.getsignal(sig)
            if old in (signal.SIG_DFL, signal.default_int_handler):
                self._old_handlers[sig] = old
                signal.signal(sig, handler)

    def _restore_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    # ------------------------------------------------------------------ building

    def _add_netns(self, ns: str) -> str:
        full = self.netns(ns)
        self._created.append(full)  # before creation: a half-made one is removed too
        _sh(["ip", "netns", "add", full])
        _sh(["ip", "-n", full, "link", "set", "lo", "up"])
        # the flow ports lie inside the ephemeral range: reserved, the kernel never hands one out to
        # another connection, which would hold a stream's port (EADDRINUSE) for as long as it lives
        reserved = f"{FLOW_PORT_BASE}-{FLOW_PORT_BASE + FLOW_PORT_SPAN - 1}"
        for key, val in (
            ("net.ipv4.tcp_tw_reuse", "1"),
            ("net.ipv6.conf.all.disable_ipv6", "1"),
            ("net.ipv4.ip_local_reserved_ports", reserved),
        ):
            _sh(["ip", "netns", "exec", full, "sysctl", "-qw", f"{key}={val}"], check=False)
        return full

    def _build(self) -> None:
        o = self._add_netns(ORIGIN)
        _sh(["ip", "-n", o, "addr", "add", f"{self.addr(ORIGIN)}/32", "dev", "lo"])
        _sh(["ip", "netns", "exec", o, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        for i, reg in enumerate(self._regions):
            r = self._add_netns(reg.name)
            oif = _ORIGIN_IF.format(i)
            # Both ends are created inside their namespaces: no name ever exists in the host's.
            _sh(["ip", "link", "add", oif, "netns", o, "type", "veth", "peer", "name", _REGION_IF, "netns", r])
            net = f"10.77.{i + 1}"
            _sh(["ip", "-n", o, "addr", "add", f"{net}.254/24", "dev", oif])
            _sh(["ip", "-n", r, "addr", "add", f"{net}.1/24", "dev", _REGION_IF])
            for k in range(self.hosts_per_region):
                _sh(["ip", "-n", r, "addr", "add", f"{self.addr(reg.name, k)}/24", "dev", _REGION_IF])
            _sh(["ip", "-n", o, "link", "set", oif, "up"])
            _sh(["ip", "-n", r, "link", "set", _REGION_IF, "up"])
            # origin speaks from 10.77.0.1 to every region; regions route everything via origin
            _sh(["ip", "-n", o, "route", "replace", f"{net}.0/24", "dev", oif, "src", self.addr(ORIGIN)])
            _sh(["ip", "-n", r, "route", "add", "default", "via", f"{net}.254", "src", f"{net}.1"])
            if reg.link_mbit is not None:
                self._shape(o, oif, reg)
                self._shape(r, _REGION_IF, reg)

    def _shape(self, ns: str, dev: str, reg: Region) -> None:
        """htb on dev's egress: parent 1:1 at link rate; leaves 1:2 (default) and 1:1xx (flows)."""
        assert reg.link_mbit is not None
        tc = ["tc", "-n", ns]
        link = reg.link_mbit
        _sh([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "2"])
        self._htb_class(tc, dev, "1:", "1:1", link, link)
        if reg.per_flow_mbit is None:
            self._htb_class(tc, dev, "1:1", "1:2", link, link)
            return
        cap = min(reg.per_flow_mbit, link)
        share = link / (self.flow_classes + 1)  # guaranteed rate; classes borrow up to `cap`
        self._htb_class(tc, dev, "1:1", "1:2", share, cap)
        mask = 0xFF00 | (self.flow_classes - 1)
        for k in range(self.flow_classes):
            cid = f"1:{0x100 + k:x}"
            self._htb_class(tc, dev, "1:1", cid, share, cap)
            value = FLOW_PORT_BASE | k
            # dport first: a packet towards the client; then sport: a packet from the client
            for prio, field in ((1, "dport"), (2, "sport")):
                _sh(
                    [
                        *tc,
                        "filter",
                        "add",
                        "dev",
                        dev,
                        "parent",
                        "1:",
                        "protocol",
                        "ip",
                        "prio",
                        str(prio),
                        "u32",
                        "match",
                        "ip",
                        field,
                        hex(value),
                        hex(mask),
                        "flowid",
                        cid,
                    ]
                )

    def _htb_class(self, tc: list[str], dev: str, parent: str, cid: str, rate: float, ceil: float) -> None:
        burst = max(128 * 1024, int(ceil * 125_000 * 0.002))  # >= 2 GSO packets or 2 ms
        _sh(
            [
                *tc,
                "class",
                "add",
                "dev",
                dev,
                "parent",
                parent,
                "classid",
                cid,
                "htb",
                "rate",
                _kbit(rate),
                "ceil",
                _kbit(ceil),
                "burst",
                str(burst),
                "cburst",
                str(burst),
                "quantum",
                "65536",
            ]
        )
        if cid != "1:1":  # leaf: a byte fifo of queue_ms at the ceiling rate
            limit = max(256 * 1024, int(ceil * 125_000 * self.queue_ms / 1000))
            _sh([*tc, "qdisc", "add", "dev", dev, "parent", cid, "bfifo", "limit", str(limit)])


# ---------------------------------------------------------------------- cleanup


def _netns_list() -> list[str]:
    res = _sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _kill_netns_pids(full: str) -> None:
    for _ in range(3):
        res = _sh(["ip", "netns", "pids", full], check=False)
        pids = [int(x) for x in res.stdout.split() if x.isdigit()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def _del_netns(full: str) -> None:
    for _ in range(5):
        if _sh(["ip", "netns", "del", full], check=False).returncode == 0:
            return
        if full not in _netns_list():
            return
        time.sleep(0.2)
    print(f"wan: could not delete netns {full}", file=sys.stderr)


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie's run is over


def cleanup(all_runs: bool = False, verbose: bool = True) -> list[str]:
    """Remove namespaces (with their processes and veths) and host links named sprl-*.

    By default only leftovers of runs whose process is gone (the pid in the name); with
    all_runs=True also those of live runs.
    """
    removed = []
    for full in _netns_list():
        if not full.startswith(PREFIX):
            continue
        m = re.match(rf"^{re.escape(PREFIX)}(\d+)-", full)
        if not all_runs and m and _pid_alive(int(m.group(1))):
            if verbose:
                print(f"keep {full} (pid {m.group(1)} alive; --all to remove)")
            continue
        _kill_netns_pids(full)
        _del_netns(full)
        removed.append(full)
    res = _sh(["ip", "-o", "link", "show"], check=False)
    for line in res.stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(PREFIX):
                _sh(["ip", "link", "del", name], check=False)
                removed.append(name)
    if verbose:
        for name in removed:
            print(f"removed {name}")
        if not removed:
            print("nothing to remove")
    return removed


# ---------------------------------------------------------------------- selftest helpers
# `_serve` and `_xfer` run inside the namespaces (as separate processes).

_CHUNK = 256 * 1024
_ZEROS = bytes(_CHUNK)


class _Handler(socketserver.BaseRequestHandler):
    """Request line `GET n` (server sends n bytes) or `PUT n` (client sends n, server says OK).

    The server always closes first, so TIME_WAIT stays on the server and the client can reuse
    its fixed port for the next transfer at once.
    """

    def handle(self) -> None:
        sock: socket.socket = self.request
        f = sock.makefile("rb")
        op, n = f.readline().split()
        n = int(n)
        if op == b"GET":
            left = n
            while left:
                left -= sock.send(memoryview(_ZEROS)[: min(left, _CHUNK)])
        else:
            got = 0
            while got < n:
                b = f.read1(min(n - got, _CHUNK))
                if not b:
                    return
                got += len(b)
            sock.sendall(b"OK\n")
        sock.shutdown(socket.SHUT_WR)


def _serve(port: int) -> None:
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    socketserver.ThreadingTCPServer.daemon_threads = True
    socketserver.ThreadingTCPServer.request_queue_size = 128  # default 5 drops SYNs of 8 streams
    with socketserver.ThreadingTCPServer(("0.0.0.0", port), _Handler) as srv:
        print("ready", flush=True)
        srv.serve_forever()


def _one(host: str, port: int, local_port: int, op: str, n: int, out: dict[str, Any]) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if local_port:
        s.bind(("0.0.0.0", local_port))
    t0 = time.perf_counter()
    s.connect((host, port))
    s.sendall(f"{op} {n}\n".encode())
    got = 0
    if op == "GET":
        buf = bytearray(_CHUNK)
        while True:
            k = s.recv_into(buf)
            if not k:
                break
            got += k
    else:
        left = n
        while left:
            left -= s.send(memoryview(_ZEROS)[: min(left, _CHUNK)])
        s.shutdown(socket.SHUT_WR)
        got = n if s.recv(16).startswith(b"OK") else 0
    t1 = time.perf_counter()
    s.close()
    out.update(port=local_port, bytes=got, t0=t0, t1=t1, mbit=got * 8 / (t1 - t0) / 1e6)


def _xfer(host: str, port: int, op: str, nbytes: int, local_ports: list[int]) -> dict[str, Any]:
    results: list[dict[str, Any]] = [{} for _ in local_ports]
    threads = [
        threading.Thread(target=_one, args=(host, port, lp, op, nbytes, results[j])) for j, lp in enumerate(local_ports)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(r["bytes"] for r in results)
    span = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    return {
        "streams": [round(r["mbit"], 1) for r in results],
        "total_mbit": round(total * 8 / span / 1e6, 1),
        "seconds": round(span, 2),
        "bytes": total,
    }


def selftest() -> int:
    link, per_flow = 200, 50
    mb = 1_000_000
    t_start = time.monotonic()
    with Wan(regions=["us", "eu"], link_mbit=link, per_flow_mbit=per_flow) as wan:
        print(
            f"wan: prefix {wan.prefix}, link {link} Mbit/s, per flow {per_flow} Mbit/s, "
            f"{wan.flow_classes} flow classes, built in {time.monotonic() - t_start:.1f} s"
        )
        for ns in wan.sites:
            print(f"  {wan.netns(ns):28s} {wan.addr(ns)}")
        me = os.path.abspath(__file__)
        srv_port = 8000
        servers = {}
        for ns in (ORIGIN, "us"):  # origin for WAN tests, us for the intra-region test
            p = wan.popen(ns, [sys.executable, me, "_serve", str(srv_port)], stdout=subprocess.PIPE, text=True)
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"server in {ns} did not start")
            servers[ns] = p

        def xfer(ns: str, host: str, op: str, n: int, ports: list[int]) -> dict[str, Any]:
            res = wan.run(
                ns,
                [sys.executable, me, "_xfer", host, str(srv_port), op, str(n), *map(str, ports)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if res.returncode != 0:
                raise RuntimeError(f"_xfer failed: {res.stderr}")
            return json.loads(res.stdout)

        origin = wan.addr(ORIGIN)
        fp = flow_port
        cases = [
            (
                "1 stream, download origin->us (port 40960)",
                "us",
                origin,
                "GET",
                16 * mb,
                [fp(0)],
                (0.85 * per_flow, 1.05 * per_flow),
            ),
            (
                "4 streams, download origin->us (ports 40960-40963)",
                "us",
                origin,
                "GET",
                16 * mb,
                [fp(i) for i in range(4)],
                (0.9 * link, 1.05 * link),
            ),
            (
                "4 streams in ONE class (ports 40960,40976,40992,41008)",
                "us",
                origin,
                "GET",
                4 * mb,
                [fp(16 * i) for i in range(4)],
                (0.85 * per_flow, 1.05 * per_flow),
            ),
            (
                "1 stream, ephemeral port (default class)",
                "us",
                origin,
                "GET",
                8 * mb,
                [0],
                (0.85 * per_flow, 1.05 * per_flow),
            ),
            (
                "4 streams, upload eu->origin (ports 40964-40967)",
                "eu",
                origin,
                "PUT",
                16 * mb,
                [fp(4 + i) for i in range(4)],
                (0.9 * link, 1.05 * link),
            ),
            (
                "1 stream, intra-region us->us over loopback (unshaped)",
                "us",
                wan.addr("us"),
                "GET",
                200 * mb,
                [fp(0)],
                (2 * link, float("inf")),
            ),
        ]
        ok = True
        for title, ns, host, op, n, ports, (lo, hi) in cases:
            r = xfer(ns, host, op, n, ports)
            good = lo <= r["total_mbit"] <= hi
            ok &= good
            streams = " + ".join(f"{s:.1f}" for s in r["streams"]) if len(ports) > 1 else ""
            print(
                f"{'ok  ' if good else 'FAIL'} {title}: {r['total_mbit']:.1f} Mbit/s"
                f"{' (' + streams + ')' if streams else ''} in {r['seconds']:.2f} s"
                f" [expect {lo:.0f}..{hi:.0f}]"
            )

        # both regions at once: separate links, each should fill its own 200 Mbit/s
        procs = {
            ns: wan.popen(
                ns,
                [
                    sys.executable,
                    me,
                    "_xfer",
                    origin,
                    str(srv_port),
                    "GET",
                    str(16 * mb),
                    *map(str, (fp(i) for i in range(4))),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for ns in ("us", "eu")
        }
        both = {ns: json.loads(p.communicate(timeout=60)[0]) for ns, p in procs.items()}
        for ns, r in both.items():
            good = 0.9 * link <= r["total_mbit"] <= 1.05 * link
            ok &= good
            print(
                f"{'ok  ' if good else 'FAIL'} concurrent: 4 streams origin->{ns}: "
                f"{r['total_mbit']:.1f} Mbit/s in {r['seconds']:.2f} s"
                f" [expect {0.9 * link:.0f}..{1.05 * link:.0f}]"
            )
    print(f"selftest {'passed' if ok else 'FAILED'} in {time.monotonic() - t_start:.1f} s (torn down)")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wan.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{selftest,cleanup}")
    sub.add_parser("selftest", help="build 2 regions (200/50 Mbit/s), measure, tear down")
    c = sub.add_parser("cleanup", help="remove leftover sprl-* namespaces and links")
    c.add_argument("--all", action="store_true", help="also those of runs still alive")
    s = sub.add_parser("_serve")  # internal: selftest server
    s.add_argument("port", type=int)
    x = sub.add_parser("_xfer")  # internal: selftest client
    x.add_argument("host")
    x.add_argument("port", type=int)
    x.add_argument("op", choices=["GET", "PUT"])
    x.add_argument("nbytes", type=int)
    x.add_argument("local_ports", type=int, nargs="+", help="0 = ephemeral")
    a = ap.parse_args(argv)
    if a.cmd == "selftest":
        return selftest()
    if a.cmd == "cleanup":
        cleanup(all_runs=a.all)
        return 0
    if a.cmd == "_serve":
        _serve(a.port)
        return 0
    if a.cmd == "_xfer":
        print(json.dumps(_xfer(a.host, a.port, a.op, a.nbytes, a.local_ports)))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
