"""Drift (drift.py): what the server or others add is none; an edited object, or a field no
longer decided, is applied again with a Corrected Event."""

from __future__ import annotations

import copy

import pytest
from test_operator_decisions import World, body, settled

from sparrowrl_operator.builders import merge
from sparrowrl_operator.reconcile import Actions


def fields_v1(value: dict) -> dict:
    """FieldsV1 as an API server records an apply of `value`: `f:` per map key, a "." for a map's
    own presence, `k:` for list items (here by position, which is enough: they are not followed)."""
    out: dict = {}
    for k, v in value.items():
        if isinstance(v, dict):
            out[f"f:{k}"] = {".": {}, **fields_v1(v)}
        elif isinstance(v, list):
            out[f"f:{k}"] = {f'k:{{"i":{i}}}': fields_v1(x) if isinstance(x, dict) else {} for i, x in enumerate(v)}
        else:
            out[f"f:{k}"] = {}
    return out


def as_served(obj: dict, extra: dict) -> dict:
    """An object as a real API server answers a list: no apiVersion and kind, identity metadata,
    this operator's apply recorded in managedFields, and `extra` merged in (server defaults)."""
    out = {k: v for k, v in copy.deepcopy(obj).items() if k not in ("apiVersion", "kind")}
    applied = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
    applied["metadata"] = {k: v for k, v in obj["metadata"].items() if k not in ("name", "namespace")}
    out["metadata"] |= {
        "uid": "x-1",
        "resourceVersion": "42",
        "creationTimestamp": "2026-12-01T12:00:00Z",
        "managedFields": [
            {
                "manager": "sparrowrl-operator",
                "operation": "Apply",
                "fieldsType": "FieldsV1",
                "fieldsV1": fields_v1(applied),
            },
            {"manager": "kube-controller-manager", "operation": "Update", "fieldsV1": {"f:status": {}}},
        ],
    }
    return merge(out, extra)


def corrected(actions: Actions) -> list[str]:
    return [m for _, r, m in actions.events if r == "Corrected"]


def test_what_the_server_adds_is_no_drift():
    """Defaults, allocated addresses, identity metadata, managedFields and others' labels: what the
    operator decides is all there, so nothing is applied, cycle after cycle."""
    w, job = settled()
    server = {
        "Service": {
            "spec": {
                "clusterIP": "10.0.0.7",
                "clusterIPs": ["10.0.0.7"],
                "sessionAffinity": "None",
                "ipFamilies": ["IPv4"],
                "ipFamilyPolicy": "SingleStack",
                "externalTrafficPolicy": "Cluster",
            },
            "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}},
        },
        "Secret": {"metadata": {"annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"}}},
        "ConfigMap": {"metadata": {"labels": {"team": "rl"}}},
    }
    for cluster, objects in w.objects.items():
        for (kind, _), obj in objects.items():
            extra = copy.deepcopy(server.get(kind, {}))
            if kind == "Service":  # a node port in each port (named: merged into the port of that name)
                extra["spec"]["ports"] = [
                    {"name": p["name"], "nodePort": 31234 + i} for i, p in enumerate(obj["spec"]["ports"])
                ]
            obj.update(as_served(obj, extra))
    assert w.objects[None]["Secret", "add-grpo-token"]["data"] == {"token": "dG9r"}  # base64, as served
    assert w.objects[None]["Service", "add-grpo-trainer"]["spec"]["ports"][0]["nodePort"] == 31234
    for t in (2, 3):
        actions = w.step(job, t)
        assert actions.apply == [] and actions.create == [] and corrected(actions) == []


@pytest.mark.parametrize(
    ("cluster", "kind", "name", "edit", "where"),
    [
        (None, "Service", "add-grpo-trainer", lambda o: o["spec"]["ports"][0].update(port=9999), "spec.ports[0]"),
        (None, "Service", "add-grpo-trainer", lambda o: o["spec"].update(type="ClusterIP"), "spec.type"),
        (None, "Secret", "add-grpo-token", lambda o: o["metadata"]["labels"].pop("sparrowrl.dev/job"), "metadata"),
        (None, "ConfigMap", "add-grpo-job", lambda o: o["data"].update({"job.yaml": "not: [a job"}), "data"),
        (
            "eu-west",
            "Secret",
            "add-grpo-u-1-worker-eu-0-token",
            lambda o: o["data"].update({"trainer-key": "eA=="}),
            "data",
        ),
        ("eu-west", "Service", "add-grpo-u-1-relay-eu", lambda o: o["spec"].pop("selector"), "spec.selector"),
    ],
)
def test_an_edited_object_is_applied_again(cluster, kind, name, edit, where):
    w, job = settled()
    before = copy.deepcopy(w.objects[cluster][kind, name])
    edit(w.objects[cluster][kind, name])
    actions = w.step(job, 2)
    assert [(c, m["kind"], m["metadata"]["name"]) for c, m in actions.apply] == [(cluster, kind, name)]
    assert actions.create == [] and actions.delete == []
    assert w.objects[cluster][kind, name] == before  # applied as first decided
    (message,) = corrected(actions)
    assert message.startswith(f"{kind} {name}" + (f" in cluster {cluster}" if cluster else "")) and where in message
    assert w.step(job, 3).apply == []


def test_an_object_without_its_labels_is_applied_not_created():
    """It no longer shows in the operator's labelled lists: applied, it gets them back (a create
    would have met a 409 and left it so)."""
    w, job = settled()
    del w.objects["ap-south"]["Service", "add-grpo-u-1-relay-ap"]
    actions = w.step(job, 2)
    assert [(c, m["metadata"]["name"]) for c, m in actions.apply] == [("ap-south", "add-grpo-u-1-relay-ap")]
    assert corrected(actions) == []  # missing is not drift: its Event would say nothing useful


def test_a_field_no_longer_decided_is_dropped():
    """An annotation the job no longer asks for: its apply removes it. One someone else added
    (not in this operator's managedFields) is theirs, and no reason to apply."""
    w, job = World(), body()
    job["spec"]["trainer"]["service"]["annotations"] = {"lb.example.com/internal": "true"}
    w.step(job, 0)
    key = ("Service", "add-grpo-trainer")
    svc = w.objects[None][key] = as_served(w.objects[None][key], {"metadata": {"annotations": {"mine": "yes"}}})
    w.step(job, 1)  # the rest of the job's objects
    assert w.step(job, 2).apply == []
    job["spec"]["trainer"]["service"]["annotations"] = {}
    actions = w.step(job, 3)
    assert [m["metadata"]["name"] for _, m in actions.apply] == ["add-grpo-trainer"]
    assert "metadata.annotations" in corrected(actions)[0]
    assert "lb.example.com/internal" in str(svc["metadata"]["managedFields"])
