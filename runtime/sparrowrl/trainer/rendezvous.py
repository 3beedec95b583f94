"""How the nodes of a trainer meet: torch.distributed's TCP store, hosted by node 0's first
process at the address every node is given (in a cluster, pod 0's stable name behind a headless
Service; under `sparrowrl run`, loopback), as torchrun's static rendezvous does.

Each node's first process connects and writes what it is under `node/K`: its accelerators, torch's
build and the job it runs. Node 0 waits for every node, `trainer.joinTimeoutSeconds` at most, and
then either admits the gang or refuses it, naming the node that did not join or that differs from
node 0; every node reads that verdict before any collective. Only then does each node start its
other ranks, and all of them join one process group over the same store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from sparrowrl.spec.job import JobSpec

log = logging.getLogger(__name__)

PORT = 29500  # torchrun's default MASTER_PORT: what a cluster's node 0 listens on
VERDICT = "sparrowrl/verdict"
MAX_DESCRIPTION = 64 << 10  # bytes a node may write about itself
TIMEOUT = timedelta(minutes=30)  # a collective that waits longer than this fails (a step can be long)
NODE0_WAIT = 86_400.0  # seconds a node waits for node 0 to host the rendezvous (its check and downloads)


class GangError(RuntimeError):
    """The gang cannot start: a node did not join in time, or differs from node 0."""


@dataclass(frozen=True)
class Gang:
    """This process's place in the trainer: `node` of `nodes`, each of `per_node` ranks, meeting
    at `host:port`, which node 0 listens on at its own address `bind`; `threads`: the CPU threads
    each rank takes (the ranks on a machine share it)."""

    nodes: int
    per_node: int
    node: int
    host: str
    port: int
    join_timeout: float
    threads: int
    bind: str = "127.0.0.1"

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @property
    def first(self) -> int:
        """The global rank of this node's first process (which serves, on node 0)."""
        return self.node * self.per_node

    @classmethod
    def of(
        cls,
        spec: JobSpec,
        node: int = 0,
        address: str | None = None,
        threads: int | None = None,
        bind: str = "127.0.0.1",
    ) -> Gang:
        """The gang of `spec`'s trainer as node `node` sees it; without `address`, one node on
        loopback (nothing else joins it). `bind`: node 0's own address, where it listens for the
        others."""
        t = spec.trainer
        if not 0 <= node < t.nodes:
            raise GangError(f"--node {node}: the job's trainer has nodes 0..{t.nodes - 1} (trainer.nodes {t.nodes})")
        if address is None:  # one machine: its ranks meet on loopback, never on the pod's address
            if t.nodes > 1:
                raise GangError(f"trainer.nodes is {t.nodes}: give --rendezvous HOST:PORT, node 0's address")
            host = bind = "127.0.0.1"
            port = _free_port(host) if t.ranks > 1 else 0
        else:
            host, port = parse_address(address)
        return cls(
            t.nodes,
            t.ranks,
            node,
            host,
            port,
            float(t.join_timeout_seconds),
            threads or max(1, (os.cpu_count() or 1) // t.ranks),
            bind,
        )


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise GangError(f"--rendezvous {address!r}: expected HOST:PORT, node 0's address and a port 1-65535")
    return host.strip("[]"), int(port)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def describe(spec: JobSpec) -> dict:
    """What a node must share with node 0: its accelerators (model, count, memory), torch's build,
    and the job (a node started with another spec would train another model)."""
    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    job = json.dumps(spec.model_dump(mode="json", include={"seed", "model", "task", "grpo", "sync", "trainer"}))
    return {
        "accelerators": sorted({g.name for g in gpus}) or ["cpu"],
        "gpus": len(gpus),
        "memory_gib": sorted({round(g.total_memory / 2**30) for g in gpus}),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "job": hashlib.sha256(job.encode()).hexdigest()[:16],
    }


def differs(nodes: dict[int, dict]) -> str | None:
    """Why the gang of these nodes' descriptions cannot train together (the first node that
    differs from node 0, and how), or None."""
    base = nodes[0]
    for k in sorted(nodes):
        for key in sorted(set(base) | set(nodes[k])):
            if nodes[k].get(key) != base.get(key):
                what = "the job spec" if key == "job" else key
                return (
                    f"node {k} differs from node 0 in {what}: {nodes[k].get(key)} where node 0 has "
                    f"{base.get(key)} (every node of a trainer needs the same GPUs, torch and job)"
                )
    return None


def meet(gang: Gang, me: dict) -> dist.TCPStore:
    """This node's first process joins the gang (node 0's hosts its store); returns the store
    once node 0 has admitted every node. Raises GangError naming what kept the gang from starting."""
    # node 0 waits joinTimeoutSeconds for the others once it is here; they wait for it longer,
    # since its check and its downloads come first
    wait = timedelta(seconds=gang.join_timeout if gang.node == 0 else NODE0_WAIT)
    try:
        store = _host(gang, wait) if gang.node == 0 else dist.TCPStore(gang.host, gang.port, timeout=wait)
    except (OSError, RuntimeError, ValueError) as e:
        where = f"host the rendezvous at {gang.bind}" if gang.node == 0 else f"reach node 0 at {gang.host}"
        raise GangError(
            f"node {gang.node}: cannot {where}:{gang.port} in {wait.total_seconds():.0f} s: {_first_line(e)}"
        ) from None
    store.set(f"sparrowrl/node/{gang.node}", json.dumps(me))
    if gang.node == 0:
        _admit(store, gang, me)
    try:
        store.wait([VERDICT])
        verdict = store.get(VERDICT).decode()
    except (RuntimeError, ValueError) as e:
        raise GangError(f"node {gang.node}: node 0 gave no verdict on the gang: {_first_line(e)}") from None
    if verdict:
        raise GangError(verdict)
    return store


def _host(gang: Gang, wait: timedelta) -> dist.TCPStore:
    """Node 0's store, listening on its own address only (a pod's IP), not every interface."""
    family = socket.AF_INET6 if ":" in gang.bind else socket.AF_INET
    fd = socket.create_server((gang.bind, gang.port), family=family).detach()
    try:
        return dist.TCPStore(
            gang.host, gang.port, is_master=True, timeout=wait, wait_for_workers=False, master_listen_fd=fd
        )
    except BaseException:
        os.close(fd)
        raise


def _admit(store: dist.TCPStore, gang: Gang, me: dict) -> None:
    """Node 0's verdict on the gang, which every node reads: also when node 0 cannot give one."""
    try:
        verdict = _judge(store, gang, me)
    except BaseException:
        store.set(VERDICT, "node 0 stopped before it admitted the gang (its log says why)")
        raise
    store.set(VERDICT, verdict)
    if verdict:
        raise GangError(verdict)
    if gang.nodes > 1:
        log.info(f"trainer: {gang.nodes} nodes joined, {gang.world} ranks")


def _judge(store: dist.TCPStore, gang: Gang, me: dict) -> str:
    others = [f"sparrowrl/node/{k}" for k in range(1, gang.nodes)]
    if others:
        log.info(f"trainer: waiting for nodes 1..{gang.nodes - 1} to join ({gang.join_timeout:.0f} s at most)")
        try:
            store.wait(others)
        except (RuntimeError, ValueError):
            missing = [k for k, key in enumerate(others, 1) if not store.check([key])]
            return (
                f"trainer.nodes: node{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of "
                f"{gang.nodes} did not join in {gang.join_timeout:.0f} s (trainer.joinTimeoutSeconds)"
            )
    nodes = {0: me}
    for k, key in enumerate(others, 1):
        raw = store.get(key)
        try:
            said = json.loads(raw) if len(raw) <= MAX_DESCRIPTION else f"{len(raw)} bytes"
        except ValueError:
            said = "not JSON"
        nodes[k] = (
            said if isinstance(said, dict) else {"description": said if isinstance(said, str) else "not an object"}
        )
    return differs(nodes) or ""


def join(gang: Gang, rank: int, store: dist.TCPStore | None = None) -> None:
    """Global rank `rank` joins the process group (its own client of the store, unless given)."""
    local = rank - gang.first
    if store is None:  # node 0's ranks dial its own address: never an older node 0 the name may still give
        host = gang.bind if gang.node == 0 else gang.host
        store = dist.TCPStore(host, gang.port, is_master=False, timeout=timedelta(seconds=gang.join_timeout))
    store.set_timeout(TIMEOUT)  # from now on the process group's: its collectives' bound
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(gang.world), LOCAL_RANK=str(local))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    torch.set_num_threads(gang.threads)
    dist.init_process_group(backend(), store=store, rank=rank, world_size=gang.world, timeout=TIMEOUT)


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
