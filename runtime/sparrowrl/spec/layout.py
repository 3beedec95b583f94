"""Which processes a job runs: one pure function of the spec. `sparrowrl run` starts its roles as
local processes; the operator turns the same roles into pods. Only how a role is reached (a
loopback port; a Service name, or a load balancer's address from a member cluster) differs, and
that is the caller's `url(role name, region it is reached from)`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from sparrowrl.spec.job import JobSpec

INVALID_EXIT = 3  # `sparrowrl check`: the job cannot run where it was checked (the operator's InvalidSpec)


@dataclass(frozen=True)
class Process:
    """One process a job runs: its role, its name, its region, and where it fetches from."""

    kind: Literal["trainer", "relay", "worker"]
    name: str  # unique in the job, a DNS label: trainer, relay-REGION, worker-REGION-I
    region: str | None = None
    trainer: str | None = None  # relays fetch from it; workers take work from it, and versions last
    relay: str | None = None  # a worker's first source of versions: its region's relay
    rate_mbit: float | None = None  # cap on this role's downloads: the region's link to the trainer


def processes(spec: JobSpec, url: Callable[[str, str], str]) -> list[Process]:
    """The trainer; per region with workers, its relay (unless `relay: false`) and its workers.
    A region's link cap applies where its traffic crosses the link: to its relay's upstream, or
    to each worker when it has no relay."""
    out = [Process("trainer", "trainer")]
    for region in spec.regions:
        if not region.workers:
            continue
        trainer, relay, rate = url("trainer", region.name), None, region.bandwidth_mbit
        if region.relay:
            out.append(Process("relay", f"relay-{region.name}", region.name, trainer, rate_mbit=rate))
            relay, rate = url(f"relay-{region.name}", region.name), None  # inside a region the network is not capped
        out += [
            Process("worker", f"worker-{region.name}-{i}", region.name, trainer, relay, rate)
            for i in range(region.workers)
        ]
    return out
