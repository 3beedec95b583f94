"""A trainer of several nodes in a cluster: the operator makes a pod per node, each on a claim
of its own, and they meet at node 0 through a headless Service (the stand-in kubelet runs each
pod as local processes, gloo between them). Two nodes publish what one node of two ranks
publishes; a node killed mid-run restarts the gang, which resumes and completes; a node that
never joins is named when node 0 gives up on it."""

from __future__ import annotations

import json

import pytest
from support.kube import clusters, until
from support.kubelet import kubelets
from support.operator_run import operator

from sparrowrl.store.store import Store

pytestmark = [pytest.mark.kube, pytest.mark.e2e, pytest.mark.xdist_group("clusters")]

JOBS = "sparrowrl.dev/v1alpha1/sparrowrljobs"
NS = "default"


def job(name: str, steps: int, **trainer) -> dict:
    return {
        "apiVersion": "sparrowrl.dev/v1alpha1",
        "kind": "SparrowRLJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "steps": steps,
            "seed": 1,
            "model": {"tiny": {"hidden": 32, "layers": 1, "heads": 2}},
            "task": {"builtin": "add"},
            "grpo": {"groupSize": 4, "promptsPerStep": 4, "maxNewTokens": 3, "learningRate": 1e-3},
            "rollout": {"groupsPerLease": 1, "leaseSeconds": 10},
            "sync": {"staleness": 0, "baseEvery": 100},  # one worker at staleness 0: the same batches in each job
            "placements": [{"region": "us", "replicas": 1, "relay": False}],
            "trainer": trainer,
        },
    }


def status(home, name: str) -> dict:
    return (home.get(JOBS, NS, name) or {}).get("status") or {}


def finished(home, name: str, within: float = 300) -> dict:
    return until(
        lambda: (s := status(home, name)).get("phase") in ("Succeeded", "Failed") and s, within, f"{name} finished"
    )


def condition(s: dict, type_: str) -> dict:
    return next((c for c in s.get("conditions") or [] if c["type"] == type_), {})


def paused(kubelet, name: str) -> bool:
    """SIGSTOP to the pod's processes, once they run: it runs, and never joins."""
    try:
        kubelet.pause(NS, name)
    except AssertionError:  # not started yet
        return False
    return True


def pods(home) -> set[str]:
    return {p["metadata"]["name"] for p in home.list("v1/pods", NS)}


@pytest.mark.timeout(600)
def test_two_nodes_train_as_one_node_of_two_ranks_and_a_node_that_never_joins_is_named(tmp_path):
    with clusters("home") as (home,), kubelets(home, root=tmp_path) as (k_home,), operator(home):
        home.create(job("solo", 4, ranks=2))
        home.create(job("pair", 4, nodes=2))
        lonely = job("lonely", 4, nodes=2, joinTimeoutSeconds=10)
        lonely["spec"]["runPolicy"] = {"backoffLimit": 0}
        home.create(lonely)
        until(lambda: paused(k_home, "lonely-trainer-node1-0"), 60, "the lonely job's node 1 running")
        for name in ("solo", "pair"):
            s = finished(home, name)
            assert s["phase"] == "Succeeded", condition(s, "Failed")
        volumes = tmp_path / "home" / "volumes" / NS
        solo, pair = (Store(volumes / f"{n}-state" / "store").versions for n in ("solo", "pair"))
        assert {v: x.state_hash for v, x in pair.items()} == {v: x.state_hash for v, x in solo.items()}
        assert len(pair) == 5
        summary = json.loads((volumes / "pair-state" / "summary.json").read_text())
        assert summary["weights_mismatch"] == 0 and summary["prompt_groups_lost"] == 0
        assert [p.name for p in (volumes / "pair-state-node1" / "trainer" / "v00000004").iterdir()] != []
        assert status(home, "pair")["trainerNodes"][1]["pod"] == "pair-trainer-node1-0"

        s = finished(home, "lonely", 120)
        said = condition(s, "Failed")["message"]
        assert s["phase"] == "Failed" and "node 0: pod lonely-trainer-0" in said, said
        assert "trainer.nodes: node 1 of 2 did not join in 10 s (trainer.joinTimeoutSeconds)" in said, said
        assert [(n["node"], n["pod"]) for n in s["trainerNodes"]] == [
            (0, "lonely-trainer-0"),
            (1, "lonely-trainer-node1-0"),
        ]  # the failed job freed its pods: the paused one too


@pytest.mark.timeout(600)
def test_a_node_killed_mid_run_restarts_the_gang_which_resumes_and_completes(tmp_path):
    """kill -9 of node 1's pod: node 0 sees its collectives fail and ends too; the operator
    makes both pods again (one restart), each resumes from its own claim, and the job completes
    with every commit verified and no prompt group lost."""
    with clusters("home") as (home,), kubelets(home, root=tmp_path) as (k_home,), operator(home):
        home.create(job("gang", 24, nodes=2, checkpoint={"every": 5}))
        until(lambda: status(home, "gang").get("progress", {}).get("step", 0) >= 8, 300, "the gang training")
        k_home.kill(NS, "gang-trainer-node1-0")
        s = finished(home, "gang", 400)
        assert s["phase"] == "Succeeded", condition(s, "Failed")
        assert s["restarts"] == 1
        assert {"gang-trainer-1", "gang-trainer-node1-1"} <= pods(home)
        log = k_home.log(NS, "gang-trainer-1") or ""
        assert "resumed at v" in log, log[-2000:]
        summary = json.loads((tmp_path / "home" / "volumes" / NS / "gang-state" / "summary.json").read_text())
        assert summary["final_version"] == 24 and summary["weights_mismatch"] == 0
        assert summary["prompt_groups_lost"] == 0 and summary["trainer_restarts"] == 1
