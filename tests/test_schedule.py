"""The scheduler: how a batch is split among workers of unequal speed and links (a table of
cases for the pure functions), and the coordinator's leases under each split policy."""

import math
import statistics

import pytest
from support import fleet

from sparrowrl.rollout import schedule
from sparrowrl.rollout.coordinator import Coordinator
from sparrowrl.rollout.schedule import Seat, Shares, Speed


def seats(*rows):
    return {name: Seat(ready, rate) for name, ready, rate in rows}


# (groups, tokens per group, workers (name, ready s, tokens/s), expected shares, expected finish s)
TABLE = [
    # equal workers share equally
    (8, 10, [("a", 0, 10), ("b", 0, 10)], {"a": 4, "b": 4}, 4.0),
    # 4:1 speed: 4:1 shares, everyone done at 16·10 / 50 = 3.2 s
    (16, 10, [("fast", 0, 40), ("slow", 0, 10)], {"fast": 13, "slow": 3}, 3.2),
    # 4:1 with two of each: ideal is 32 groups at 100 tokens/s
    (32, 10, [("f1", 0, 40), ("f2", 0, 40), ("s1", 0, 10), ("s2", 0, 10)], {"f1": 13, "f2": 13, "s1": 3, "s2": 3}, 3.2),
    # a slow link: b starts 2 s late and takes 2 groups fewer
    (8, 10, [("a", 0, 10), ("b", 2, 10)], {"a": 5, "b": 3}, 5.0),
    # a link so slow that the others finish first: no share at all
    (4, 10, [("a", 0, 10), ("b", 0, 10), ("far", 30, 10)], {"a": 2, "b": 2, "far": 0}, 2.0),
    # a busy worker (its last lease still running) is counted from when it is free
    (6, 10, [("idle", 0, 10), ("busy", 3, 10)], {"idle": 5, "busy": 1}, 4.5),
    # one group left: to whoever finishes it first
    (1, 10, [("slow", 0, 1), ("fast", 0.5, 100)], {"slow": 0, "fast": 1}, 60 / 101),
    # remainders: the earlier starter wins a tie
    (3, 10, [("a", 0, 10), ("b", 0, 10)], {"a": 2, "b": 1}, 1.5),
]


@pytest.mark.parametrize("groups,tpg,workers,shares,finish", TABLE)
def test_split_equalizes_expected_finish(groups, tpg, workers, shares, finish):
    s = seats(*workers)
    assert schedule.finish_time(groups, tpg, s) == pytest.approx(finish)
    got = schedule.split(groups, tpg, s)
    assert got == shares and sum(got.values()) == groups
    # nobody's whole-group finish is later than the exact finish plus one of its own groups
    for w, n in got.items():
        if n:
            assert s[w].ready_s + n * tpg / s[w].tokens_per_s <= finish + tpg / s[w].tokens_per_s + 1e-9


def test_split_without_workers_or_groups():
    assert schedule.split(0, 10, seats(("a", 0, 1))) == {"a": 0}
    assert schedule.split(5, 10, {}) == {}
    with pytest.raises(ValueError):
        schedule.finish_time(5, 10, {})


def test_speed_is_its_last_leases_and_starts_afresh_when_it_collapses():
    s = Speed()
    assert s.tokens_per_s is None and s.cap == schedule.PROBE and s.noise is None
    s.generated(100, 1.0, 1)
    assert (s.tokens_per_s, s.cap, s.noise) == (100, 2, None)
    s.generated(300, 1.0, 2)  # tokens over seconds of its leases
    assert (s.tokens_per_s, s.cap) == (200, 4)
    assert s.noise == pytest.approx(math.log(3) ** 2 / 4)  # the log-rates' variance over their count
    s.generated(150, 1.5, 4)  # slower, but within RESET of the estimate: one lease of three
    assert s.tokens_per_s == pytest.approx(550 / 3.5)
    for _ in range(schedule.WINDOW):  # the window forgets the oldest
        s.generated(120, 1.0, 4)
    assert (s.tokens_per_s, s.noise) == (pytest.approx(120), pytest.approx(0))
    s.generated(50, 1.0, 4)  # under half the estimate: the machine changed, the window starts afresh
    assert (s.tokens_per_s, s.noise) == (50, None)
    for bad in ((0, 1.0), (10, 0.0), (10, float("nan")), (10, float("inf")), (10, 5e-324)):
        s.generated(*bad, 1)
        assert s.tokens_per_s == 50
    assert s.fetch_s(1000) == 0.0  # link not measured yet
    s.fetched(1000, 2.0)
    assert s.fetch_s(1000) == 2.0


def test_shrink_pulls_noise_to_the_fleet_and_keeps_true_differences():
    # identical workers whose leases were noisy: the spread of their rates is all noise
    noisy = {"a": 90.0, "b": 110.0, "c": 95.0, "d": 105.0}
    middle = math.exp(sum(map(math.log, noisy.values())) / 4)
    assert schedule.shrink(noisy, dict.fromkeys(noisy, 0.01)) == dict.fromkeys(noisy, pytest.approx(middle))
    # 4:1 workers measured precisely: kept, bar a shade
    apart = {"f1": 40.0, "f2": 40.0, "s1": 10.0, "s2": 10.0}
    got = schedule.shrink(apart, dict.fromkeys(apart, 1e-4))
    assert got == {w: pytest.approx(r, rel=1e-3) for w, r in apart.items()}
    # ten truly 4x slower among a thousand barely widen the fleet's spread, and stay slow
    fleet_rates = {f"w{i}": (25.0 if i < 10 else 100.0 * (1 + 0.05 * ((i % 3) - 1))) for i in range(1000)}
    got = schedule.shrink(fleet_rates, dict.fromkeys(fleet_rates, 0.05**2))
    assert all(got[f"w{i}"] < 100 / 3 for i in range(10))
    assert all(95 < got[w] < 105 for w in list(got)[10:])
    # the noisier a rate, the more it is pulled in; one of one lease is kept as measured
    mixed = {"a": 50.0, "b": 150.0, "c": 100.0, "d": 120.0, "e": 90.0}
    got = schedule.shrink(mixed, {"a": 0.2, "b": None, "c": 0.01, "d": 0.01, "e": 0.01})
    assert got["b"] == 150.0 and 50 < got["a"] < 100
    assert math.log(got["a"] / 50) > abs(math.log(got["d"] / 120))
    # too few to tell noise from spread, or nothing known of the noise: unchanged
    assert schedule.shrink({"a": 1.0, "b": 2.0}, {"a": 9.0, "b": 9.0}) == {"a": 1.0, "b": 2.0}
    assert schedule.shrink(mixed, dict.fromkeys(mixed)) == mixed


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def coordinator(split, per_step=16, per_lease=4, staleness=0):
    clock = Clock()
    c = Coordinator(per_step, per_lease, lease_seconds=100, staleness=staleness, steps=4, split=split, clock=clock)
    c.publish(0, "h0", payload_bytes=1000)
    return c, clock


def deliver(c, clock, worker, lease, tokens_per_s, tokens_per_group=10):
    """The worker generates its lease at `tokens_per_s` and reports it."""
    seconds = len(lease["groups"]) * tokens_per_group / tokens_per_s
    clock.t += seconds
    results = {
        g: {"samples": [{"tokens": [1] * tokens_per_group, "logprobs": [-1.0] * tokens_per_group}]}
        for g in lease["groups"]
    }
    return c.submit(lease["id"], worker, 0, "h0", results, seconds)


def test_balanced_probes_new_workers_and_ramps_them_up():
    c, clock = coordinator("balanced", per_step=16, per_lease=8)
    fast, slow = c.work("fast", 0)["lease"], c.work("slow", 0)["lease"]
    assert len(fast["groups"]) == len(slow["groups"]) == schedule.PROBE  # not measured yet
    deliver(c, clock, "fast", fast, 40)
    deliver(c, clock, "slow", slow, 10)
    # 14 groups left, both idle, 4:1: shares 11 and 3, each capped at twice its last lease
    fast = c.work("fast", 0)["lease"]
    assert len(fast["groups"]) == 2
    assert len(c.work("slow", 0)["lease"]["groups"]) == 2
    deliver(c, clock, "fast", fast, 40)
    assert len(c.work("fast", 0)["lease"]["groups"]) == 4


def test_balanced_a_worker_that_would_finish_last_waits():
    c, clock = coordinator("balanced", per_step=4, per_lease=4)
    for w, rate in (("fast", 100), ("slow", 1)):
        lease = c.work(w, 0)["lease"]
        deliver(c, clock, w, lease, rate)
    c.fleet["fast"].speed.last_lease = 4
    # 2 groups left: the slow worker takes 10 s per group, the fast one 0.1 s
    assert c.work("slow", 0) == {"wait": True}
    assert len(c.work("fast", 0)["lease"]["groups"]) == 2


def test_balanced_counts_the_fetch_of_a_slow_link():
    c, clock = coordinator("balanced", per_step=8, per_lease=8, staleness=0)
    while not (b := c.batch(0)) or not b.complete:
        for w in ("near", "far"):
            if lease := c.work(w, 0).get("lease"):
                deliver(c, clock, w, lease, 10)
    c.commit("near", 0, "h0", fetch_s=0.1)
    c.commit("far", 0, "h0", fetch_s=4.0)  # 1000 bytes in 4 s
    c.take(0)
    c.publish(1, "h1", payload_bytes=1000)
    assert c.work("far", 0) == {"update": 1}  # only workers that hold an eligible version get work
    c.commit("near", 1, "h1", fetch_s=0.1)
    c.fleet["near"].speed.last_lease = 8  # as after a few leases: its ramp is past this batch
    # far needs 4 s to fetch v1 before it can start: 8 groups at 1 s each, near 0 → 6, far 4 → 6
    assert len(c.work("near", 1)["lease"]["groups"]) == 6


def test_a_worker_back_after_a_lease_period_is_probed_again():
    c, clock = coordinator("balanced", per_step=16, per_lease=8)
    deliver(c, clock, "w", c.work("w", 0)["lease"], 10)
    c.fleet["w"].speed.last_lease = 8
    assert len(c.work("w", 0)["lease"]["groups"]) == 8
    clock.t += 200  # silent for two lease periods (its lease expired)
    assert len(c.work("w", 0)["lease"]["groups"]) == schedule.PROBE


def test_even_gives_each_live_worker_its_quota_and_the_rest_once_all_are_out():
    c, clock = coordinator("even", per_step=8, per_lease=8)
    c.heard("a"), c.heard("b")
    c.work("a", 0), c.work("b", 0)  # a's first lease is its whole quota
    assert c.batch(0).given == {"a": 4, "b": 4}
    c2, clock2 = coordinator("even", per_step=8, per_lease=2)
    for w in "ab":
        c2.heard(w)
    got = [len(c2.work("a", 0)["lease"]["groups"]) for _ in range(2)]
    assert got == [2, 2] and c2.work("a", 0) == {"wait": True}  # b's quota is b's
    assert len(c2.work("b", 0)["lease"]["groups"]) == 2


def test_pull_gives_every_ask_the_same_lease():
    c, clock = coordinator("pull", per_step=8, per_lease=3)
    assert [len(c.work(w, 0)["lease"]["groups"]) for w in "abc"] == [3, 3, 2]


def simulate(split, rates, fetch_s, steps=6, per_step=32, per_lease=4, tokens_per_group=10, train_s=0.5):
    """A job against the coordinator on a simulated clock, staleness 0: workers generate at
    `rates` (tokens/s), receive each version `fetch_s` after it is published, and ask for work
    whenever they are idle. Returns each batch's time from its version's publish to its last
    group, and the ideal: the batch split in proportion to true speed, each worker starting
    once its fetch is done."""
    import heapq

    clock = Clock()
    c = Coordinator(per_step, per_lease, lease_seconds=1e6, staleness=0, steps=steps, split=split, clock=clock)
    c.publish(0, "h0", payload_bytes=1000)
    arrived = {w: {0: 0.0} for w in rates}
    events, waiting, times, ahead = [], set(), [], set()  # ahead: told to reach a version not yet published

    def at(t, kind, w, data=None):
        heapq.heappush(events, (t, len(events) + len(times) * 10**6, kind, w, data))

    for w in rates:
        c.heard(w)
        at(0.0, "ask", w)
    while events:
        t, _, kind, w, data = heapq.heappop(events)
        clock.t = t
        if kind == "publish":
            c.publish(data, f"h{data}", payload_bytes=1000)
            for x in rates:
                arrived[x][data] = t + fetch_s[x]
                at(t + fetch_s[x], "commit", x, data)
                if x in ahead:  # its fetcher has it then, and it asks again
                    at(t + fetch_s[x], "ask", x)
            ahead.clear()
        elif kind == "commit":
            c.commit(w, data, f"h{data}", fetch_s=fetch_s[w])
            continue
        elif kind == "deliver":
            lease, v = data
            results = {g: {"samples": [{"tokens": [1] * tokens_per_group}]} for g in lease["groups"]}
            c.submit(lease["id"], w, v, f"h{v}", results, len(lease["groups"]) * tokens_per_group / rates[w])
            if batch := c.take(lease["batch"]):
                times.append(batch.done - batch.opened)
                if batch.index + 1 < steps:
                    at(t + train_s, "publish", None, batch.index + 1)
            waiting.add(w)
        else:
            version = max(v for v, when in arrived[w].items() if when <= t)
            ans = c.work(w, version)
            if "lease" in ans:
                seconds = len(ans["lease"]["groups"]) * tokens_per_group / rates[w]
                at(t + seconds, "deliver", w, (ans["lease"], version))
            elif "update" in ans and ans["update"] in arrived[w]:
                at(arrived[w][ans["update"]], "ask", w)
            elif "update" in ans:
                ahead.add(w)
            elif "wait" in ans:
                waiting.add(w)
            continue
        for x in sorted(waiting):  # something changed: whoever waits asks again
            at(t, "ask", x)
        waiting.clear()
    ideal = schedule.finish_time(per_step, tokens_per_group, {w: Seat(fetch_s[w], r) for w, r in rates.items()})
    return times, ideal


def test_balanced_split_finishes_batches_within_10_percent_of_ideal():
    """4:1 speeds, one slow link: the balanced split is within 10% of ideal from the second
    batch on (the first one probes), and ahead of pull and of an even split."""
    rates = {"fast1": 40, "fast2": 40, "slow1": 10, "slow2": 10}
    fetch_s = {"fast1": 0.1, "fast2": 0.1, "slow1": 0.1, "slow2": 1.0}
    steady = {}
    for split in ("balanced", "pull", "even"):
        times, ideal = simulate(split, rates, fetch_s)
        assert len(times) == 6
        steady[split] = max(times[1:])
    assert steady["balanced"] <= 1.1 * ideal
    assert steady["balanced"] < steady["pull"] < steady["even"]


def test_a_stale_plan_moves_the_last_planned_group_to_an_idle_asker_who_finishes_it_sooner():
    tpg = 10.0
    ends = [(-2.0, "a"), (-1.5, "b")]  # a: 2 groups from 0 s, b: 1 group from 0.5 s, at 10 tokens/s
    plan = Shares(0.0, 3, {"a": 2, "b": 1, "c": 0, "d": 0}, dict.fromkeys("abcd", 10.0), ends)
    assert plan.steal(1.0, tpg)  # c would finish one group at 1.0 s: a's second group
    assert (plan.shares, plan.pending) == ({"a": 1, "b": 1, "c": 0, "d": 0}, 2)
    assert plan.steal(1.2, tpg)  # a now ends at 1.0 s, b at 1.5 s
    assert plan.shares["b"] == 0
    assert not plan.steal(1.2, tpg)  # a, the last holder, ends sooner
    plan.shares["a"] = 0  # a took its share
    assert not plan.steal(0.1, tpg) and plan.pending == 1  # nothing planned is left to move


def test_a_thousand_workers_step_within_10_percent_of_ten_under_lease_noise():
    """The fleet of `hack/bench_scale.py` in virtual time: a thousand groups a step, each lease
    within ±25% of its mean time, so a thousand identical workers look unequal. A thousand
    workers step within 10% of ten, losing no group (before the window, the shrink and the
    steal: 1.25x)."""
    ten = fleet.mean_step(10)
    runs = [fleet.run(1000, seed=s) for s in range(3)]
    assert sum(r.lost for r in runs) == 0
    assert statistics.mean(r.step_s for r in runs) <= 1.1 * ten, (ten, [r.steps_s for r in runs])


def test_a_thousand_workers_half_of_them_4x_slower_still_split_by_speed():
    """Shrinking rates toward the fleet must not erase true differences: with half the fleet
    4x slower, the balanced split still beats first come, first served, a group at a time."""
    slowness = {"slowness": lambda i: 4.0 if i % 2 else 1.0, "seeds": 1, "steps": 9}
    balanced = fleet.mean_step(1000, **slowness)
    pull = fleet.mean_step(1000, split="pull", groups_per_lease=1, **slowness)
    assert balanced < 0.9 * pull, (balanced, pull)


def test_ten_workers_4x_slower_among_a_thousand_keep_their_rate():
    """Ten truly slow workers barely widen the fleet's spread, and each delivers a lease in
    four steps: shrunk to the fleet's rate, they were handed the last groups of batches, and
    the step took 1.6x that of an identical fleet. Kept slow, they cost little."""
    same = fleet.mean_step(1000, seeds=1, steps=9)
    few = fleet.mean_step(1000, seeds=1, steps=9, slowness=lambda i: 4.0 if i % 100 == 1 else 1.0)
    assert few < 1.15 * same, (few, same)
