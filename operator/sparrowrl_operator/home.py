"""The job's objects in the operator's own cluster, which its pods use: the trainer's Secret,
ConfigMap and Service, applied as decided, and the state's volume claim, made once and then
owned as the retention policy says."""

from __future__ import annotations

from sparrowrl_operator import builders
from sparrowrl_operator.constants import (
    ADOPTED,
    CLAIM_CONFLICT,
    JOB_LABEL,
    MANAGED_BY_LABEL,
    MANAGER,
    STEPS_RAISED,
    UID_LABEL,
)
from sparrowrl_operator.cycle import Facts, Outcome
from sparrowrl_operator.drift import ensure


def reconcile_objects(c: Facts, out: Outcome) -> bool:
    """The home objects, and the Created condition. Whether the state's claim is an earlier job's,
    being deleted: the trainer waits for a new one."""
    job, spec = c.job, c.spec
    config = c.seen(None, "ConfigMap", builders.config_name(job)) or {}
    written = (config.get("data") or {}).get(builders.JOB_KEY)
    raised = builders.raised_from(job, c.document, written)
    if raised is not None:
        out.event(
            STEPS_RAISED, f"spec.steps raised from {raised} to {spec.steps}: the trainer trains on from its state"
        )
    manifests = [
        builders.token_secret(job, c.obs.token, job.namespace, home=True),
        builders.job_config(job, c.document, written),
        builders.trainer_service(job, spec),
        *([builders.nodes_service(job)] if spec.trainer.nodes > 1 else []),
    ]
    raise_only = raised is not None  # the ConfigMap's apply is the raise, not a correction
    missing = [m["kind"] for m in manifests if not ensure(c, out, None, m, m["kind"] == "ConfigMap" and raise_only)]
    claims = [_state_claim(c, out, k) for k in range(spec.trainer.nodes)]
    going = any(g for _, g in claims)
    if not all(e for e, _ in claims):
        missing.insert(2, "PersistentVolumeClaim")
    out.condition(
        "Created",
        not missing,
        "ObjectsCreated" if not missing else "Creating",
        "the trainer's Secret, ConfigMap, volume claim and Service exist"
        if spec.trainer.nodes == 1
        else f"the trainer's Secret, ConfigMap, {spec.trainer.nodes} volume claims and Services exist"
        if not missing
        else f"creating {', '.join(missing)}",
    )
    return going


def _state_claim(c: Facts, out: Outcome, node: int) -> tuple[bool, bool]:
    """A trainer node's claim (observed by name, whatever its labels): made once; one retained
    from an earlier job of this name is adopted (the trainer resumes from it, and refuses
    another job's state); its owner follows the retention policy. One this operator did not
    make for a job of this name is never touched: the job fails. Whether it exists, and whether
    it is an earlier job's, going."""
    job, name = c.job, builders.claim_name(c.job, node)
    seen = c.seen(None, "PersistentVolumeClaim", name)
    if seen is None:
        out.actions.create.append((None, builders.state_claim(job, c.spec, node)))
        return False, False
    labels = seen["metadata"].get("labels") or {}
    if labels.get(MANAGED_BY_LABEL) != MANAGER or labels.get(JOB_LABEL) != job.name:
        out.fail(
            CLAIM_CONFLICT,
            f"PersistentVolumeClaim {name} exists and is not one this operator made for a job named {job.name}; "
            "it is left alone: delete it, or give the job another name",
        )
        return True, False
    refs = seen["metadata"].get("ownerReferences") or []
    if seen["metadata"].get("deletionTimestamp") or any(
        r.get("kind") == "SparrowRLJob" and r.get("name") == job.name and r.get("uid") != job.uid for r in refs
    ):
        return False, True  # its owner, an earlier job of this name, went: made again once gone
    if patch := builders.claim_patch(job, c.spec, seen):
        out.actions.patch.append((None, "PersistentVolumeClaim", job.namespace, name, patch))
        if labels.get(UID_LABEL) != job.uid:
            out.event(
                ADOPTED,
                f"PersistentVolumeClaim {name}, retained from an earlier job of this name, holds this job's "
                "state now: the trainer resumes from it, and refuses it if it is another job's (then delete "
                "the claim to start afresh)",
            )
    return True, False


def claim_as_decided(c: Facts, out: Outcome) -> bool:
    """A finished job's claim follows its retention policy as it is now: a user who switches to
    Retain to keep the model keeps it. Whether it follows it already (the job may go)."""
    settled = True
    for node in range(c.spec.trainer.nodes):
        name = builders.claim_name(c.job, node)
        seen = c.seen(None, "PersistentVolumeClaim", name)
        if seen is None or (seen["metadata"].get("labels") or {}).get(UID_LABEL) != c.job.uid:
            continue  # none of this job's
        if patch := builders.claim_patch(c.job, c.spec, seen):
            out.actions.patch.append((None, "PersistentVolumeClaim", c.job.namespace, name, patch))
            settled = False
    return settled
