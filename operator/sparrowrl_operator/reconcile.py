"""The operator's decisions, as one pure function: a job, what is observed in each cluster and
from the trainer, and the time → the objects to create, apply and delete, the status, the Events.
The kopf handlers only observe, call `reconcile` and carry out its actions; tests call it with
tables of scenarios. It decides from the current state, never from the event that woke it,
so running it twice does no harm (watches replay). Each concern decides in a module of its own;
this one runs them in order, and is where callers import the cycle's types from."""

from __future__ import annotations

from pydantic import ValidationError

from sparrowrl.spec.job import JobError, parse
from sparrowrl.spec.kubespec import MANAGED_BY
from sparrowrl_operator import builders, health, home, lifecycle, network, placements, status, tls, trainer
from sparrowrl_operator.builders import JobRef
from sparrowrl_operator.constants import INVALID
from sparrowrl_operator.cycle import Actions, Backoff, Facts, Member, Network, Observed, Outcome
from sparrowrl_operator.model import SparrowRLJobStatus
from sparrowrl_operator.pods import Pods
from sparrowrl_operator.times import stamp

__all__ = ["Actions", "Backoff", "Member", "Network", "Observed", "reconcile"]
_PARSED = ("apiVersion", "kind", "metadata", "spec")  # the job as `parse` reads it: no status


def reconcile(
    body: dict, observed: Observed, image: str, backoff: Backoff = Backoff(), network: Network = Network()
) -> Actions:
    """What to do for one job, from its body (as stored) and what is observed."""
    meta = body["metadata"]
    job = JobRef(meta["name"], meta["namespace"], meta["uid"])
    pods = Pods(observed.pods)
    prev = _previous(body)
    out = Outcome(prev, stamp(observed.now), meta.get("generation"))
    try:
        spec = parse({k: body[k] for k in _PARSED}, f"{job.namespace}/{job.name}").spec
    except JobError as e:
        return _invalid(out, pods, observed, str(e))
    except KeyError as e:
        return _invalid(out, pods, observed, f"{e.args[0]}: missing")
    if spec.manager != MANAGED_BY:
        return Actions()  # e.g. kueue.x-k8s.io/multikueue: another controller runs it, and writes its status
    spec = tls.effective(spec, pods)
    if why := builders.names_fit(job, spec) or tls.refused_url(spec):
        return _invalid(out, pods, observed, why)
    c = Facts(job, spec, body["spec"], observed, image, backoff, prev, pods, network)
    clusters = (0, 0)  # reachable, used: only an active job's placements count them
    lifecycle.reopen_raised(c, out)
    if out.terminal:
        lifecycle.finish(c, out)
    elif c.spec.run_policy.suspend:
        lifecycle.suspend(c, out)
    else:
        clusters = _active(c, out)
    status.display(c, out, clusters)
    return _done(out, observed)


def _active(c: Facts, out: Outcome) -> tuple[int, int]:
    """A job neither finished nor suspended: each concern in turn, until one finishes it. The
    clusters reachable and used, once the placements have looked."""
    lifecycle.resume(out)
    if lifecycle.past_deadline(c, out):
        return 0, 0
    claim_going = home.reconcile_objects(c, out)
    if out.terminal:  # the state's claim is someone else's
        lifecycle.finish(c, out)
        return 0, 0
    network.reconcile_policy(c, out, None, c.job.namespace)
    trust = tls.authority(c, out)
    if trust is not None:
        tls.serve(c, out, trust, None, trainer.ROLE, c.job.namespace, tls.trainer_names(c))
    certified = trust is not None or not builders.encrypted(c.spec)  # pods made now find their certificates
    trainer.reconcile_trainer(c, out, claim_going, certified)
    if out.terminal:
        lifecycle.finish(c, out)
        return 0, 0
    stale = health.stale_workers(c)
    clusters = placements.reconcile_placements(c, out, stale, trust)
    if out.terminal:  # every worker given up
        lifecycle.finish(c, out)
        return clusters
    status.progress(c, out, stale)
    if health.leases(c, out, stale):
        lifecycle.finish(c, out)
    health.weights(c, out)
    health.trust(c, out)
    return clusters


def _invalid(out: Outcome, pods: Pods, observed: Observed, message: str) -> Actions:
    if not out.terminal:  # a finished job's spec no longer matters
        out.fail(INVALID, message)
    lifecycle.free(pods, out)
    return _done(out, observed)


def _done(out: Outcome, observed: Observed) -> Actions:
    """The cycle's actions with its status, its phase derived once, from the conditions."""
    t = observed.trainer
    out.update(phase=status.derive_phase(out.status.conditions, t is not None and t.phase != "Pending"))
    out.actions.status = out.status
    return out.actions


def _previous(body: dict) -> SparrowRLJobStatus:
    """The status as last written; one that does not parse (edited by hand) starts afresh."""
    try:
        return SparrowRLJobStatus.model_validate(body.get("status") or {})
    except ValidationError:
        return SparrowRLJobStatus()
