"""Traffic only where it belongs (network.py), decided: a NetworkPolicy per job in each cluster,
valid by Kubernetes' own schema, selecting exactly the job's pods and admitting only what the
job needs. The emulated clusters do not enforce NetworkPolicies, and neither does any cluster
whose network plugin does not: what is checked here is the objects."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
from kubernetes_validate.utils import latest_version
from test_operator_decisions import MEMBERS, World, body

from sparrowrl_operator.cycle import Network

OPERATOR = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "sparrowrl-system"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "sparrowrl-operator"}},
}
CHART = Network(True, ({"namespaceSelector": {}},), OPERATOR)


def policies(w: World) -> dict:
    return {(c, n): o for c, objs in w.objects.items() for (k, n), o in objs.items() if k == "NetworkPolicy"}


def selects(policy: dict, pod: dict) -> bool:
    want = policy["spec"]["podSelector"]["matchLabels"]
    labels = pod["metadata"].get("labels") or {}
    return policy["metadata"]["namespace"] == pod["metadata"]["namespace"] and all(
        labels.get(k) == v for k, v in want.items()
    )


def ports(rule: dict) -> set[int]:
    return {p["port"] for p in rule["ports"]}


def running(job: dict, network: Network = CHART, members=MEMBERS) -> World:
    w = World(members=members)
    w.step(job, 0, network=network)
    w.step(job, 0, network=network)
    return w


def test_each_cluster_gets_a_valid_policy_that_selects_exactly_the_jobs_pods():
    w = running(body())
    other_job = body()
    other_job["metadata"] |= {"name": "other", "uid": "u-2"}
    other = running(other_job)  # another job's pods, beside this one's in the same namespaces
    got = policies(w)
    assert set(got) == {
        (None, "add-grpo-network"),
        ("eu-west", "add-grpo-u-1-network"),
        ("ap-south", "add-grpo-u-1-network"),
    }
    for (cluster, _), policy in got.items():
        manifest = {k: v for k, v in policy.items() if k in ("apiVersion", "kind", "metadata", "spec")}
        kubernetes_validate.validate(manifest, latest_version(), strict=True)
        mine, theirs = w.pods.get(cluster, {}).values(), other.pods.get(cluster, {}).values()
        assert mine and all(selects(policy, p) for p in mine)
        assert theirs and not any(selects(policy, p) for p in theirs)


def test_what_each_policy_admits():
    w = running(body())
    home = policies(w)[None, "add-grpo-network"]["spec"]
    member = policies(w)["eu-west", "add-grpo-u-1-network"]["spec"]
    assert home["policyTypes"] == member["policyTypes"] == ["Ingress"]  # what leaves is not limited
    job_pods = {"podSelector": {"matchLabels": {"sparrowrl.dev/job-uid": "u-1"}}}
    by_source = {str(r.get("from", "anyone")): ports(r) for r in home["ingress"]}
    assert by_source == {
        str([job_pods]): {8470, 8471},  # the job's own pods: the trainer's and the relays' ports
        "anyone": {8470},  # the trainer's load balancer: the member clusters' workers
        str([OPERATOR]): {8470},  # the operator reads the trainer's /v1/status
        str([{"namespaceSelector": {}}]): {9090},  # the metrics scraper
    }
    assert {str(r.get("from", "anyone")): ports(r) for r in member["ingress"]} == {
        str([job_pods]): {8470, 8471},
        str([{"namespaceSelector": {}}]): {9090},
    }  # a member's workers reach their relay; nothing else reaches them


def test_a_trainer_only_its_cluster_reaches_admits_no_one_else_and_no_scraper_means_no_rule():
    job = body(placements=[{"region": "us", "replicas": 1}], trainer={"service": {"type": "ClusterIP"}})
    w = running(job, Network(True, (), OPERATOR), members={})
    (policy,) = policies(w).values()
    assert all("from" in r for r in policy["spec"]["ingress"])  # an empty `from` would admit everyone
    assert {p for r in policy["spec"]["ingress"] for p in ports(r)} == {8470, 8471}


def test_policies_follow_the_job_and_the_operator_default():
    assert policies(running(body(networkPolicy={"mode": "Disabled"}))) == {}
    off = Network(jobs=False)
    assert policies(running(body(), off)) == {}  # the chart's networkPolicy.jobs: false
    assert len(policies(running(body(networkPolicy={"mode": "Enabled"}), off))) == 3  # the job's own word
    job = body()
    w = running(job)
    job["spec"]["networkPolicy"] = {"mode": "Disabled"}
    actions = w.step(job, 5, network=CHART)
    assert sorted((c or "home", k, n) for c, k, _, n in actions.delete) == [
        ("ap-south", "NetworkPolicy", "add-grpo-u-1-network"),
        ("eu-west", "NetworkPolicy", "add-grpo-u-1-network"),
        ("home", "NetworkPolicy", "add-grpo-network"),
    ]


@pytest.mark.parametrize(
    "text, why",
    [
        ("{", "not JSON"),
        ('{"jobs": "yes"}', "jobs must be true or false"),
        ('{"metricsFrom": [{}]}', "metricsFrom must be a list of NetworkPolicyPeers"),
        ('{"operator": []}', "operator must be a NetworkPolicyPeer"),
        ('{"job": true}', "an object of jobs, metricsFrom and operator"),
    ],
)
def test_the_charts_settings_are_checked_at_start(text, why):
    with pytest.raises(ValueError, match=why):
        Network.from_json(text)
    assert Network.from_json(
        '{"jobs": false, "metricsFrom": [{"namespaceSelector": {}}], "operator": {"podSelector": {}}}'
    ) == Network(False, ({"namespaceSelector": {}},), {"podSelector": {}})


def test_a_policy_edited_by_hand_is_applied_again():
    job = body()
    w = running(job)
    policy = w.objects[None]["NetworkPolicy", "add-grpo-network"]
    before = copy.deepcopy(policy)
    policy["spec"]["ingress"] = [{}]  # admit everything
    actions = w.step(job, 1, network=CHART)
    assert [m["metadata"]["name"] for _, m in actions.apply] == ["add-grpo-network"]
    assert w.objects[None]["NetworkPolicy", "add-grpo-network"] == before


def test_a_trainers_nodes_reach_each_other_on_any_port_and_no_one_else_does():
    """The rendezvous and then gloo's or NCCL's own ports, between the trainer's pods alone: a
    policy of their own, which selects only them (the job's other pods admit no more)."""
    job = body()
    job["spec"]["trainer"] |= {"nodes": 2}
    w = running(job)
    got = policies(w)
    nodes = got[None, "add-grpo-trainer-nodes"]
    kubernetes_validate.validate(
        {k: v for k, v in nodes.items() if k in ("apiVersion", "kind", "metadata", "spec")},
        latest_version(),
        strict=True,
    )
    trainers = [p for p in w.pods[None].values() if p["metadata"]["labels"]["sparrowrl.dev/role"] == "trainer"]
    others = [p for p in w.pods[None].values() if p not in trainers]
    assert (
        len(trainers) == 2 and all(selects(nodes, p) for p in trainers) and not any(selects(nodes, p) for p in others)
    )
    (rule,) = nodes["spec"]["ingress"]
    assert "ports" not in rule and rule["from"] == [{"podSelector": nodes["spec"]["podSelector"]}]
    assert got[None, "add-grpo-network"] == policies(running(body()))[None, "add-grpo-network"]  # unchanged
    assert (None, "add-grpo-trainer-nodes") not in policies(running(body()))
    w.step(job, 1, network=Network(False, (), None))  # policies off: both go
    assert not policies(w)
