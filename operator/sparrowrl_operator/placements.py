"""The rollout: per placement, its relay and worker slots in their cluster. A failed pod is
replaced after a backoff that grows with its slot's failures in a row, and past
runPolicy.workerBackoffLimit its slot is given up (the placement Degraded; the job fails when
every worker is). An unreachable member degrades the job while the others go on."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparrowrl.auth.tokens import Claims
from sparrowrl.spec import layout
from sparrowrl.spec.kubespec import Placement
from sparrowrl.spec.layout import Process
from sparrowrl_operator import builders, credentials, network, tls
from sparrowrl_operator.conditions import find
from sparrowrl_operator.constants import CRASH_LOOP, REPLACED, TRAINER_PORT, UNREACHABLE, WORKERS_FAILED
from sparrowrl_operator.cycle import Facts, Outcome
from sparrowrl_operator.drift import ensure
from sparrowrl_operator.model import PlacementStatus
from sparrowrl_operator.pods import (
    Cluster,
    attempt,
    failed_at,
    finished_at,
    in_a_row,
    phase_of,
    ready,
    slot_key,
    started_at,
    terminating,
    termination,
)
from sparrowrl_operator.times import since
from sparrowrl_operator.tls import Trust


@dataclass
class _Tally:
    """What the placements add up to, for the job's conditions."""

    crashed: list[str] = field(default_factory=list)  # why each slot given up was
    workers_alive: int = 0  # worker slots not given up


def trainer_address(c: Facts) -> str | None:
    """How workers in member clusters reach the trainer."""
    s = c.spec.trainer.service
    if s.url:
        return s.url.rstrip("/")
    svc = c.obs.trainer_service or {}
    scheme = builders.scheme(c.spec)
    if s.type == "LoadBalancer":
        for ing in ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []:
            if host := ing.get("ip") or ing.get("hostname"):
                return f"{scheme}://{host}:{TRAINER_PORT}"
    if s.type == "NodePort" and c.obs.node_address:
        for p in (svc.get("spec") or {}).get("ports") or []:
            if p.get("nodePort"):
                return f"{scheme}://{c.obs.node_address}:{p['nodePort']}"
    return None


def reconcile_placements(
    c: Facts, out: Outcome, stale: dict[str, float], trust: Trust | None = None
) -> tuple[int, int]:
    """Every placement's pods and status, and the Degraded and RolloutReady conditions. `stale`:
    the workers the trainer has not heard from; `trust`: the job's CA, issuing (None: the job is
    not encrypted, or its pods wait for it). The clusters reachable and used (the operator's own
    counts as one)."""
    job, spec = c.job, c.spec
    address = trainer_address(c)
    if address and address != out.status.trainer_address:
        out.update(trainer_address=address)
    where = {p.region: p for p in spec.placements or []}

    def namespace(region: str) -> str:
        p = where.get(region)
        return c.obs.members[p.cluster].namespace if p and p.cluster in c.obs.members else job.namespace

    def url(name: str, region: str) -> str:
        remote = where.get(region) is not None and where[region].cluster is not None
        if name == "trainer":
            return (address or "") if remote else builders.trainer_url(job, spec)
        return builders.relay_url(
            job.in_member() if remote else job, spec, name.removeprefix("relay-"), namespace(region)
        )

    roles = [r for r in layout.processes(spec, url) if r.kind != "trainer"]
    tally = _Tally()
    statuses, unreachable, connecting, total, reachable = [], [], [], set(), set()
    policed: set[str] = set()
    for region in spec.regions:
        p = where.get(region.name)
        cluster = p.cluster if p else None
        total.add(cluster)
        prev = next((s for s in c.prev.placements if s.region == region.name), None)
        member = c.obs.members.get(cluster) if cluster else None
        if cluster and (member is None or not member.reachable):
            if member is not None and member.reachable is None:
                connecting.append(cluster)
            else:
                unreachable.append(f"{cluster} ({member.reason if member else 'no such SparrowCluster'})")
            statuses.append(prev or PlacementStatus(region=region.name, cluster=cluster, desired=region.workers))
            tally.workers_alive += region.workers  # not seen: not given up
            continue
        reachable.add(cluster)
        mine = [r for r in roles if r.region == region.name]
        if cluster and (not address or ("Secret", builders.token_name(job)) not in c.obs.objects.get(None, ())):
            statuses.append(PlacementStatus(region=region.name, cluster=cluster, desired=region.workers))
            tally.workers_alive += region.workers
            continue  # its pods need the trainer's outside address, and their tokens the job's secret
        if cluster is not None and cluster not in policed:  # one per member cluster, its placements' namespace
            policed.add(cluster)
            network.reconcile_policy(c, out, cluster, namespace(region.name))
        statuses.append(_placement(c, out, tally, stale, cluster, namespace(region.name), region.name, mine, p, trust))
    crashed = "; ".join(tally.crashed)
    if unreachable:
        out.transition(
            "Degraded",
            True,
            UNREACHABLE,
            "unreachable: " + ", ".join(unreachable) + "; the other placements go on" + (crashed and f"; {crashed}"),
            warning=True,
        )
    elif crashed:  # each slot given up has had its Event
        out.condition("Degraded", True, CRASH_LOOP, crashed)
    elif find(out.status.conditions, "Degraded") is not None:
        out.transition(
            "Degraded", False, "AllHealthy", "every member cluster answers, and no worker or relay is given up"
        )
    out.update(placements=statuses)
    if not tally.workers_alive:  # a job has a worker (parse)
        out.fail(WORKERS_FAILED, f"every worker failed past runPolicy.workerBackoffLimit: {crashed}")
    waiting = [
        s.region for s in statuses if s.ready < (where[s.region].min_replicas if s.region in where else s.desired)
    ]
    out.condition(
        "RolloutReady",
        not waiting,
        "MinReplicasReady" if not waiting else "Waiting",
        "every placement has its minimum of ready workers"
        if not waiting
        else f"waiting for workers in {', '.join(waiting)}"
        + (
            ""
            if address or not any(where[r].cluster for r in waiting if r in where)
            else " (the trainer's address from outside is not known yet)"
        )
        + (f" (connecting to {', '.join(connecting)})" if connecting else ""),
    )
    return len(reachable), len(total)


def _placement(
    c: Facts,
    out: Outcome,
    tally: _Tally,
    stale: dict[str, float],
    cluster: Cluster,
    namespace: str,
    region: str,
    roles: list[Process],
    p: Placement | None,
    trust: Trust | None,
) -> PlacementStatus:
    """One reachable placement's relay and workers: made, replaced, given up, scaled down. While
    an encrypted job's certificates cannot be issued (`trust` None), no pod is made, and the
    running ones keep their tokens refreshed, with the CA they already trust."""
    hold = builders.encrypted(c.spec) and trust is None
    home = cluster is None
    job = c.job if home else c.job.in_member()
    secret_kept = ("Secret", builders.token_name(c.job)) in c.obs.objects.get(None, ())
    prev = next((s for s in c.prev.placements if s.region == region), PlacementStatus(region=region))
    failed = replaced = ready_n = 0
    given_up: list[str] = []  # the failed pods of slots given up
    lost = 0  # worker slots given up
    workers = [r for r in roles if r.kind == "worker"]
    if trust is not None and workers:  # one for the placement's workers: their probes and metrics
        tls.serve(c, out, trust, cluster, workers[0], namespace, builders.worker_names(job, region, namespace))
    for r in roles:
        # a placement's template is its workers'; relays have their own
        template = c.spec.relays.template if r.kind == "relay" else p.template if p is not None else None
        token = credentials.held(c, cluster, job, r)

        def keep(generation: int | None, r: Process = r, token: Claims | None = token) -> None:
            if secret_kept:  # tokens from the secret the trainer keeps, not from one about to be made
                ca = trust.ca_cert if trust else credentials.held_ca(c, cluster, job, r) if hold else None
                credentials.keep(c, out, cluster, r, namespace, ca, generation, token)

        if r.kind == "relay":
            ensure(c, out, cluster, builders.relay_service(job, region, namespace, home))
            if trust is not None:
                names = builders.service_names(builders.relay_name(job, region), namespace)
                tls.serve(c, out, trust, cluster, r, namespace, names)
        slot = workers.index(r) if r.kind == "worker" else None
        key = (r.kind, region, None if slot is None else str(slot))
        pod, older = c.pods.current(cluster, key)
        for old in older:
            out.remove(cluster, old)
        if pod is None and hold:
            if token is not None:
                keep(token.generation)
            continue
        if pod is None:
            fresh = credentials.next_generation(c, token, None)
            keep(fresh)
            out.create_pod(cluster, c.pod(cluster, r, 0, slot, namespace, template, generation=fresh))
            continue
        if terminating(pod):
            keep(credentials.generation_of(c, pod, token))
            continue  # suspended or scaled down a moment ago: its successor waits for the name
        n = attempt(pod)
        replaced += n
        phase = phase_of(pod)
        if r.kind == "worker" and ready(pod) and phase == "Running":
            ready_n += 1
        replacing, warning, failures = "", True, 0  # why the pod is replaced, if it is
        if phase == "Failed":
            failed += 1
            name, row, why = pod["metadata"]["name"], in_a_row(pod), termination(pod)
            if row > c.spec.run_policy.worker_backoff_limit:
                given_up.append(name)
                lost += r.kind == "worker"
                tally.crashed.append(_give_up(c, out, region, r, name, row, why, name not in prev.given_up))
            elif since(failed_at(pod), c.obs.now) >= c.backoff.delay(row - 1):
                replacing, failures = f"pod {name} failed ({why}), {row} in a row", row
        elif phase == "Succeeded" and _before_trainer(c, pod):
            replacing, warning = f"pod {pod['metadata']['name']} finished before the trainer started again", False
        elif r.kind == "worker" and pod["metadata"]["name"] in stale and c.spec.health.on_stale == "Replace":
            replacing = f"worker {pod['metadata']['name']} is stale"
        if replacing and not hold:  # a token of a new generation: the old one is refused once the new pod calls in
            fresh = credentials.next_generation(c, token, credentials.own_generation(pod))
            keep(fresh)
            out.create_pod(cluster, c.pod(cluster, r, n + 1, slot, namespace, template, failures, fresh))
            out.remove(cluster, pod)
            out.event(REPLACED, f"{replacing}; replaced it (replacement {n + 1})", warning=warning)
        else:
            keep(credentials.generation_of(c, pod, token))
    for stray in c.pods.of(cluster):  # scaled down
        role, reg, label = slot_key(stray)
        if role == "worker" and reg == region and label is not None and int(label) >= len(workers):
            out.remove(cluster, stray)
    tally.workers_alive += len(workers) - lost
    return PlacementStatus(
        region=region,
        cluster=cluster,
        desired=len(workers),
        ready=ready_n,
        failed=failed,
        replaced=replaced,
        given_up=given_up,
    )


def _give_up(c: Facts, out: Outcome, region: str, role: Process, pod: str, row: int, why: str, new: bool) -> str:
    """A slot past runPolicy.workerBackoffLimit: its failed pod stays (its logs, its reason), and
    the placement is Degraded; an Event says so once. Why, for the Degraded condition."""
    limit = c.spec.run_policy.worker_backoff_limit
    what = f"the relay of {region}" if role.kind == "relay" else f"worker {role.name}"
    message = f"{what} failed {row} times in a row (runPolicy.workerBackoffLimit: {limit}); pod {pod}: {why}"
    if new:
        out.event(
            CRASH_LOOP,
            message
            + "; no longer replaced: delete the pod to try again"
            + ("; workers fetch from the trainer meanwhile" if role.kind == "relay" else ""),
            warning=True,
        )
    return message


def _before_trainer(c: Facts, pod: dict) -> bool:
    """Whether `pod` exited (a worker told the job was done) before the running trainer
    started: that trainer may have steps to train (they were raised), so the slot runs again
    (after a failure restart instead, its new worker is told done at once)."""
    trainer = c.pods.trainer()
    if trainer is None or terminating(trainer) or phase_of(trainer) != "Running":
        return False
    start, end = started_at(trainer), finished_at(pod)
    return bool(start and end) and since(end, c.obs.now) >= since(start, c.obs.now)
