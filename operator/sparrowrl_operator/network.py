"""Traffic only where it belongs: a NetworkPolicy per job in each cluster where it runs, selecting
exactly its pods (by the job's uid). It admits the job's own pods to the trainer's and relays'
ports, anyone to the trainer's port where its Service takes traffic from outside (a load
balancer or node port: the member clusters' workers, whose addresses cannot be known), the
operator to the trainer's (its /v1/status), and the metrics scraper to each pod's metrics port.
A trainer of several nodes has a policy of its own besides: its pods admit each other on any
port (the rendezvous, then the collectives'). The kubelet's probes come from the node, which a
NetworkPolicy does not stop. Whether a cluster enforces it is its network plugin's business: one
that does not ignores it."""

from __future__ import annotations

from sparrowrl_operator import builders
from sparrowrl_operator.builders import JobRef
from sparrowrl_operator.constants import METRICS_PORT, RELAY_PORT, ROLE_LABEL, TRAINER_PORT, UID_LABEL
from sparrowrl_operator.cycle import Facts, Network, Outcome
from sparrowrl_operator.drift import ensure
from sparrowrl_operator.pods import Cluster


def enabled(c: Facts) -> bool:
    mode = c.spec.network_policy.mode
    return c.network.jobs if mode is None else mode == "Enabled"


def name(job: JobRef) -> str:
    return f"{job.base}-network"


def policy(job: JobRef, namespace: str, home: bool, exposed: bool, net: Network) -> dict:
    """The job's NetworkPolicy in one cluster's namespace (`home`: the trainer's; `exposed`: its
    Service takes traffic from outside the cluster)."""
    mine = {"podSelector": {"matchLabels": {UID_LABEL: job.uid}}}
    ingress: list[dict] = [{"from": [mine], "ports": _tcp(TRAINER_PORT, RELAY_PORT)}]
    if home and exposed:  # no `from`: any source, as a load balancer or node port passes them on
        ingress.append({"ports": _tcp(TRAINER_PORT)})
    if home and net.operator is not None:
        ingress.append({"from": [net.operator], "ports": _tcp(TRAINER_PORT)})
    if net.metrics_from:  # an empty `from` would admit everyone: no scraper, no rule
        ingress.append({"from": list(net.metrics_from), "ports": _tcp(METRICS_PORT)})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": builders.metadata(job, name(job), namespace, home),
        "spec": {"podSelector": {"matchLabels": {UID_LABEL: job.uid}}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def nodes_name(job: JobRef) -> str:
    return f"{job.base}-trainer-nodes"


def nodes_policy(job: JobRef) -> dict:
    """A trainer of several nodes: its pods admit each other on any port (the rendezvous, then
    gloo's or NCCL's own), and nothing else besides what the job's policy admits (policies add up)."""
    trainers = {"matchLabels": {UID_LABEL: job.uid, ROLE_LABEL: "trainer"}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": builders.metadata(job, nodes_name(job), job.namespace, True),
        "spec": {
            "podSelector": trainers,
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": trainers}]}],
        },
    }


def _tcp(*ports: int) -> list[dict]:
    return [{"protocol": "TCP", "port": p} for p in ports]


def reconcile_policy(c: Facts, out: Outcome, cluster: Cluster, namespace: str) -> None:
    """The job's policy in one cluster, as decided: made, kept, or (turned off) deleted."""
    home = cluster is None
    job = c.job if home else c.job.in_member()
    if enabled(c):
        svc = c.spec.trainer.service
        exposed = svc.type != "ClusterIP" or svc.url is not None
        ensure(c, out, cluster, policy(job, namespace, home, exposed, c.network))
    elif c.seen(cluster, "NetworkPolicy", name(job)) is not None:
        out.actions.delete.append((cluster, "NetworkPolicy", namespace, name(job)))
    if home and enabled(c) and c.spec.trainer.nodes > 1:
        ensure(c, out, cluster, nodes_policy(job))
    elif home and c.seen(cluster, "NetworkPolicy", nodes_name(job)) is not None:
        out.actions.delete.append((cluster, "NetworkPolicy", namespace, nodes_name(job)))
