"""Leases and admission: the coordinator's decisions, called directly."""

import json

from sparrowrl.rollout.coordinator import REFILL, Coordinator


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def coord(staleness=1, steps=3, per_step=4, per_lease=2, quorum=1):
    clock = Clock()
    c = Coordinator(per_step, per_lease, 10, staleness=staleness, steps=steps, split="pull", quorum=quorum, clock=clock)
    c.publish(0, "h0")
    return c, clock


def result(lease):
    return {g: {"samples": []} for g in lease["groups"]}


def test_batches_open_by_staleness_and_need_a_recent_enough_version():
    c, _ = coord(staleness=1)
    seen = [c.work("w", 0)["lease"] for _ in range(4)]  # batch 0 (groups 0-3) and batch 1 (4-7) with v0
    assert [x["batch"] for x in seen] == [0, 0, 1, 1]
    assert c.work("w", 0) == {"wait": True}  # batch 2 needs v1, which does not exist yet
    c2, _ = coord(staleness=0)
    c2.work("w", 0), c2.work("w", 0)
    assert c2.work("w", 0) == {"wait": True}  # staleness 0: only batch 0 until v1
    c2.publish(1, "h1")
    assert c2.work("w", 0) == {"update": 1}  # batch 1 needs v1: update first


def test_results_are_admitted_only_with_a_live_lease_and_the_trainers_hash():
    c, clock = coord()
    a, b = c.work("w1", 0)["lease"], c.work("w2", 0)["lease"]
    assert c.submit(a["id"], "w1", 0, "forged", result(a))["refused"].startswith("state hash")
    assert c.counts.requeued == c.counts.refused == 2  # the refused groups go back to the queue
    assert c.submit(b["id"], "w1", 0, "h0", result(b))["refused"] == f"lease {b['id']} is not w1's"
    assert c.submit(b["id"], "w2", 0, "h0", result(b)) == {"admitted": 2, "batch": 0, "groups": b["groups"]}
    again = c.work("w3", 0)["lease"]
    assert again["groups"] == a["groups"]
    assert c.submit(again["id"], "w3", 0, "h0", result(again))["admitted"] == 2
    assert c.take(0) is not None and c.counts.admitted == 4
    assert (c.lost, c.counts.trained, c.counts.requeued) == (0, 4, 2)  # requeued groups came back: none lost


def test_an_expired_lease_is_reassigned_and_a_late_duplicate_is_dropped():
    c, clock = coord()
    slow = c.work("slow", 0)["lease"]
    clock.t = 11  # past the deadline
    fast = c.work("fast", 0)["lease"]
    assert fast["groups"] == slow["groups"] and c.counts.requeued == 2 and c.counts.leases_expired == 1
    assert c.submit(fast["id"], "fast", 0, "h0", result(fast))["admitted"] == 2
    late = c.submit(slow["id"], "slow", 0, "h0", result(slow))
    assert late["admitted"] == 0 and c.counts.discarded_late == 2 and c.counts.admitted == 2


def test_a_retried_delivery_gets_its_answer_after_its_batch_is_trained_for_a_lease_period():
    """The answer lost (a trainer killed after journaling it): the restarted trainer may train the
    batch again before the worker, backing off, retries. The retry is told it was admitted, not
    counted as results discarded late; a lease period later the answer is let go."""
    c, clock = coord()
    a, b = c.work("w1", 0)["lease"], c.work("w2", 0)["lease"]
    assert c.submit(a["id"], "w1", 0, "h0", result(a))["admitted"] == 2
    assert c.submit(b["id"], "w2", 0, "h0", result(b))["admitted"] == 2
    assert c.take(0) is not None
    clock.t = 9.9
    assert c.submit(a["id"], "w1", 0, "h0", result(a)) == {"admitted": 2, "batch": 0, "groups": []}
    not_live = "is not live (expired or reassigned)"
    assert c.submit(a["id"], "w2", 0, "h0", result(a))["refused"] == f"lease {a['id']} {not_live}"
    clock.t = 10
    assert c.submit(b["id"], "w2", 0, "h0", result(b))["refused"] == f"lease {b['id']} {not_live}"
    assert c.counts.discarded_late == 2 + 2 and c.state()["delivered"] == {}


def test_a_late_result_still_counts_for_groups_nobody_delivered():
    c, clock = coord()
    slow = c.work("slow", 0)["lease"]
    clock.t = 11  # expired; its groups are back in the queue, not yet handed out again
    assert c.submit(slow["id"], "slow", 0, "forged", result(slow))["admitted"] == 0  # still hash-checked
    assert c.submit(slow["id"], "slow", 0, "h0", result(slow)) == {"admitted": 2, "batch": 0, "groups": slow["groups"]}
    other = c.work("other", 0)["lease"]
    assert not set(other["groups"]) & set(slow["groups"])  # not handed out twice


def test_too_stale_results_are_refused():
    c, _ = coord(staleness=1)
    for _ in range(4):
        c.work("w", 0)
    c.publish(1, "h1")
    lease = c.work("w", 1)["lease"]  # batch 2 needs v1 or newer
    assert lease["batch"] == 2
    assert "older than batch 2 allows (1)" in c.submit(lease["id"], "w", 0, "h0", result(lease))["refused"]


def test_done_once_every_batch_is_admitted_and_commits_are_checked():
    c, _ = coord(staleness=1, steps=1, per_step=2, per_lease=2)
    lease = c.work("w", 0)["lease"]
    c.submit(lease["id"], "w", 0, "h0", result(lease))
    assert c.work("w", 0) == {"done": 1}
    assert c.commit("w", 0, "h0") and not c.commit("w", 0, "h-other")
    assert (c.counts.verified, c.counts.mismatched) == (1, 1)


def test_a_live_lease_whose_groups_a_late_result_delivered_counts_them_once():
    """An expired lease's late results come first; the lease that took its groups over
    delivers the same groups again: dropped and counted, not admitted twice."""
    c, clock = coord()
    slow = c.work("slow", 0)["lease"]
    clock.t = 11
    fast = c.work("fast", 0)["lease"]
    assert c.submit(slow["id"], "slow", 0, "h0", result(slow))["admitted"] == 2  # late, nobody had delivered
    assert c.submit(fast["id"], "fast", 0, "h0", result(fast))["admitted"] == 0
    assert (c.counts.admitted, c.counts.discarded_late) == (2, 2)


def test_state_and_restore_carry_leases_counts_and_ids_across_a_restart():
    c, clock = coord()
    a, b = c.work("w1", 0)["lease"], c.work("w2", 0)["lease"]
    c.submit(a["id"], "w1", 0, "h0", result(a))
    saved = json.loads(json.dumps(c.state()))  # through the journal's JSON
    again, clock2 = coord()
    again.restore(saved, taken=0, results={0: c.results(0, a["groups"])})
    assert [(x.id, x.deadline) for x in again.leases()] == [(b["id"], clock2.t + 10)]  # a full period
    assert again.counts.admitted == 1 * 2 and again.batch(0).pending == []
    nxt = again.work("w3", 0)["lease"]
    assert nxt["id"] == b["id"] + 1 and nxt["batch"] == 1  # no id handed out twice
    assert again.submit(b["id"], "w2", 0, "h0", result(b))["admitted"] == 2
    assert again.take(0) is not None and again.taken == 1 and again.batch(0) is None


def test_changes_replayed_onto_a_snapshot_give_the_state():
    """The journal keeps a snapshot and then each request's changes: replayed, they must give
    exactly the state, whatever happened in between (leases, expiry, admission, commits)."""
    c, clock = coord()
    snapshot = json.loads(json.dumps(c.state()))
    c.changes()
    a, b = c.work("w1", 0, region="eu")["lease"], c.work("w2", 0, region="us")["lease"]
    c.submit(a["id"], "w1", 0, "h0", result(a), generate_s=1.5)
    c.commit("w1", 0, "h0", fetch_s=0.5)
    clock.t = 11  # b expires, its groups go to w3
    again = c.work("w3", 0)["lease"]
    c.submit(b["id"], "w2", 0, "h0", result(b), generate_s=2.0)  # late, nobody had delivered: admitted
    c.submit(b["id"], "w2", 0, "h0", result(b))  # the same delivery again: the same answer, counted once
    Coordinator.replay(snapshot, json.loads(json.dumps(c.changes())))
    assert snapshot == json.loads(json.dumps(c.state()))
    assert again["groups"] == b["groups"] and (c.counts.admitted, c.counts.discarded_late) == (4, 0)
    assert snapshot["regions"] == {"w1": "eu", "w2": "us"} and snapshot["first"] == {"w1": 0}
    assert snapshot["begun"] and snapshot["worker_seconds"] == {"0": 3.5}  # both deliveries' seconds
    restored, _ = coord()
    restored.restore(snapshot, taken=0, results={0: c.batch(0).results})
    assert restored.take(0).worker_seconds == 3.5 and restored.state()["regions"] == c.state()["regions"]


def test_the_view_reports_each_worker_from_the_coordinators_state():
    c, clock = coord()
    lease = c.work("w1", 0, region="eu")["lease"]
    c.commit("w1", 0, "h0", fetch_s=0.25, refused=2)
    c.commit("w2", 0, "forged")
    clock.t = 5
    c.publish(1, "h1")
    v = c.view()
    assert (v.published, v.state_hash, v.started, v.leases_active, v.counts.verified) == (1, "h1", True, 1, 1)
    w1, w2 = v.workers
    assert (w1.region, w1.committed, w1.verified, w1.leases, w1.refused, w1.live) == ("eu", (0, "h0"), True, 1, 2, True)
    assert (w2.verified, w2.leases, w1.seconds_since_seen) == (False, 0, 5)
    assert (
        c.fleet.transfer_s(0) == 0.25
        and c.fleet.staged(0)
        and not c.fleet.staged(1)
        and c.fleet.behind(1) == ["w1", "w2"]
    )
    c.counts.verified = 7  # a copy: readers cannot change the coordinator's counts
    c.commit("w1", 1, "h1")
    assert (c.counts.verified, v.counts.verified) == (2, 1)  # nor does the report move under its reader
    assert lease["batch"] == 0


def test_the_quorum_wait_counts_from_the_first_call_not_the_trainers_start():
    """Workers that take minutes to load their model still start together: the lease period
    that rollouts wait for the rest of the quorum begins when the first worker calls in."""
    c, clock = coord(quorum=3)
    clock.t = 1000.0  # the trainer has been up a long while: nobody has called yet
    assert not c.started()
    assert c.work("w1", 0) == {"wait": True}
    clock.t = 1010.0  # exactly a lease period (10 s) later: still waiting for the others
    assert c.work("w1", 0) == {"wait": True} and not c.view().started
    c.heard("w2")  # a later call does not restart the wait
    clock.t = 1010.5
    assert c.view().started and not c.fleet.begun  # the view says so without changing anything
    assert "lease" in c.work("w2", 0) and c.started()
    assert c.changes()[0] == ["begun"]


def test_rollouts_start_when_the_quorum_has_called_in():
    c, _ = coord(quorum=2)
    assert c.work("w1", 0) == {"wait": True}
    assert "lease" in c.work("w2", 0)  # the second of two: everyone starts on batch 0
    assert "lease" in c.work("w1", 0)


def test_a_thousand_workers_cost_a_few_passes_over_them_a_step():
    """Scale, counted: a thousand measured workers asking at once for a balanced batch take
    their shares of one solution, not a solve each (O(N²) a step), and committing a version
    one by one checks whether all have staged it a few times, not once a commit. A commit wakes
    no worker waiting for work; a publish does (`moves`)."""
    n, clock = 1000, Clock()
    c = Coordinator(n, n, 60, staleness=1, steps=4, split="balanced", quorum=n, clock=clock)
    c.publish(0, "h0")
    workers = [f"w{i:04d}" for i in range(n)]
    for w in workers:
        c.commit(w, 0, "h0", fetch_s=0.5)
    probes = [(w, c.work(w, 0)["lease"]) for w in workers]  # batch 0: a probe group each, not measured yet
    assert all(len(x["groups"]) == 1 for _, x in probes)
    clock.t = 1.0
    for w, x in probes:
        sample = {"tokens": [3] * 4, "logprobs": [-1.0] * 4}
        assert c.submit(x["id"], w, 0, "h0", {g: {"samples": [sample]} for g in x["groups"]}, 1.0)["admitted"] == 1
    before = c.passes
    leases = [c.work(w, 0)["lease"] for w in workers]  # batch 1, all at once
    assert sorted(g for x in leases for g in x["groups"]) == list(range(n, 2 * n))  # every group, one each
    assert all(len(x["groups"]) == 1 for x in leases)  # equal speeds: equal shares
    assert c.passes - before == 1, c.passes - before
    moves = c.moves
    c.publish(1, "h1")
    assert c.moves > moves
    before, moves = c.passes, c.moves
    staged = []
    for w in workers:  # each commit, then the check the trainer makes at every request while a row waits
        c.commit(w, 1, "h1", fetch_s=0.5)
        staged.append(c.fleet.staged(1))
    assert staged == [False] * (n - 1) + [True]
    assert c.passes - before <= 3, c.passes - before
    assert c.moves == moves


def test_a_worker_idle_until_a_version_sure_to_come_is_told_to_reach_it():
    """In a job of many workers, rather than a long poll here that they would all wake from at
    the publish, a worker with nothing to do until the next version goes to fetch it, once that
    version is sure to come: its batch is complete. Before, a lease of that batch could still
    come back. A job of 64 workers or fewer waits here, as it always has. The batch's
    completion wakes no waiter (`moves`): a thousand woken at once would all be answered while
    the learner starts on it; each learns of it at its next look."""
    for others, ahead in ((0, {"wait": True}), (64, {"update": 1})):
        c, _ = coord(staleness=1, steps=3, per_step=2, per_lease=2)
        for i in range(others):
            c.heard(f"x{i}")
        a, _ = c.work("w", 0)["lease"], c.work("w", 0)["lease"]  # batches 0 and 1
        assert c.work("w", 0) == {"wait": True}  # batch 2 needs v1, and batch 0's lease may expire
        moves = c.moves
        assert c.submit(a["id"], "w", 0, "h0", result(a))["admitted"] == 2
        assert c.moves == moves  # batch 0 complete: no work for waiters, who learn of it at their next look
        assert c.work("w", 0) == ahead  # v1 is not published yet, and will be


def scores(groups, flat=()):
    """The trainer's verdict on admitted groups: those in `flat` scored alike (zero variance)."""
    return {g: ([0.0, 1.0], {}, g not in flat) for g in groups}


def test_refills_replace_zero_variance_groups_within_the_batch_and_its_bound():
    """DAPO's dynamic sampling: a batch waits for its groups' scores, and each zero-variance
    group is replaced by a new group of the same batch (so of the same staleness bound), up to
    the bound; scoring again adds none; the replaced groups are not counted lost."""
    clock = Clock()
    c = Coordinator(2, 2, 10, staleness=0, steps=2, split="pull", refill=2, clock=clock)
    c.publish(0, "h0")
    first = c.work("w", 0)["lease"]
    assert c.submit(first["id"], "w", 0, "h0", result(first))["admitted"] == 2
    assert c.take(0) is None and c.unscored() == [(0, [0, 1])]  # admitted, not yet scored
    c.scored(0, scores([0, 1], flat={1}))
    refill = REFILL  # batch 0's first refill group
    assert c.batch(0).groups == [0, 1, refill] and c.counts.refilled == 1 and c.take(0) is None
    c.scored(0, scores([0, 1], flat={1}))  # the same verdict again (a restarted trainer): nothing added
    assert len(c.batch(0).groups) == 3
    lease = c.work("w", 0)["lease"]
    assert lease["batch"] == 0 and lease["groups"] == [refill]  # leased like the batch's own: v0 or newer
    assert c.submit(lease["id"], "w", 0, "h0", result(lease))["admitted"] == 1
    c.scored(0, scores([refill], flat={refill}))  # zero variance again: one more, the last the bound allows
    again = c.work("w", 0)["lease"]
    assert again["groups"] == [refill + 1] and c.batch_of(refill + 1) == 0
    clock.t = 11  # it expires: late results for it are still taken, for the batch's groups only
    assert c.submit(again["id"], "w", 0, "h0", {refill + 2: {"samples": []}})["admitted"] == 0  # never added
    assert c.submit(again["id"], "w", 0, "h0", result(again))["admitted"] == 1
    c.scored(0, scores([refill + 1], flat={refill + 1}))
    assert len(c.batch(0).groups) == 4 and c.counts.refilled == 2  # the bound: 2 per batch
    batch = c.take(0)
    assert batch is not None and batch.done is not None and len(batch.scores) == 4
    assert (c.lost, c.counts.trained, c.state()["refills"]) == (0, 2, {})
    c.publish(1, "h1")
    assert c.work("w", 1)["lease"]["groups"] == [2, 3]  # batch 1's own groups; its refills from REFILL + 2


def test_refills_are_journaled_and_restored_and_their_groups_scored_again():
    clock = Clock()
    c = Coordinator(2, 2, 10, staleness=0, steps=2, split="pull", refill=2, clock=clock)
    c.publish(0, "h0")
    snapshot = json.loads(json.dumps(c.state()))
    c.changes()
    lease = c.work("w", 0)["lease"]
    c.submit(lease["id"], "w", 0, "h0", result(lease), generate_s=1.0)
    c.scored(0, scores(lease["groups"], flat=set(lease["groups"])))
    refill = c.work("w", 0)["lease"]
    Coordinator.replay(snapshot, json.loads(json.dumps(c.changes())))
    assert snapshot == json.loads(json.dumps(c.state())) and snapshot["refills"] == {"0": 2}
    again = Coordinator(2, 2, 10, staleness=0, steps=2, split="pull", refill=2, clock=clock)
    again.publish(0, "h0")
    again.restore(snapshot, taken=0, results={0: c.batch(0).results})
    assert again.batch(0).groups == c.batch(0).groups and again.unscored() == [(0, [0, 1])]
    again.scored(0, scores([0, 1], flat={0, 1}))  # scored again: the groups it added are not added twice
    assert again.batch(0).groups == c.batch(0).groups and again.counts.refilled == 2
    assert again.submit(refill["id"], "w", 0, "h0", result(refill))["admitted"] == 2  # its lease lived on
    again.scored(0, scores(refill["groups"]))
    assert again.take(0) is not None and again.lost == 0
    Coordinator.replay(snapshot, json.loads(json.dumps(again.changes())))
    assert snapshot["refills"] == {}  # trained: nothing more to restore


def test_a_batch_trained_again_after_a_restart_keeps_its_refills_and_adds_none():
    """Killed after batch 0 was trained and published, before a checkpoint: the next trainer
    trains it again from the journal's results. Its refill groups are in those results; they are
    its groups again whatever the reward says this time, and it draws no new ones."""
    clock = Clock()
    c = Coordinator(2, 4, 10, staleness=0, steps=2, split="pull", refill=2, clock=clock)
    c.publish(0, "h0")
    lease = c.work("w", 0)["lease"]
    c.submit(lease["id"], "w", 0, "h0", result(lease))
    c.scored(0, scores([0, 1], flat={1}))
    refill = c.work("w", 0)["lease"]
    c.submit(refill["id"], "w", 0, "h0", result(refill))
    c.scored(0, scores(refill["groups"]))
    trained = c.take(0)
    c.publish(1, "h1")
    snapshot = json.loads(json.dumps(c.state()))
    assert snapshot["refills"] == {} and snapshot["counts"]["refilled"] == 1
    again = Coordinator(2, 4, 10, staleness=0, steps=2, split="pull", refill=2, clock=clock)
    again.publish(0, "h0"), again.publish(1, "h1")
    again.restore(snapshot, taken=0, results={0: trained.results})
    assert again.batch(0).groups == [0, 1, REFILL] and again.batch(0).pending == []
    again.scored(0, scores([0, 1, REFILL], flat={0, 1, REFILL}))  # another verdict: nothing added
    batch = again.take(0)
    assert batch is not None and batch.groups == [0, 1, REFILL] and again.counts.refilled == 1 and again.lost == 0


def test_a_group_alike_because_its_reward_failed_is_not_replaced():
    clock = Clock()
    c = Coordinator(2, 2, 10, staleness=0, steps=1, split="pull", refill=2, clock=clock)
    c.publish(0, "h0")
    lease = c.work("w", 0)["lease"]
    c.submit(lease["id"], "w", 0, "h0", result(lease))
    c.scored(0, {0: ([0.0, 0.0], {"timeout": 2}, False), 1: ([0.0, 1.0], {"timeout": 0}, True)})
    assert c.batch(0).groups == [0, 1] and c.take(0) is not None
