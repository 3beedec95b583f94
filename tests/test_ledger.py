"""What a user watches a job by: the trainer's line per step and its Prometheus gauges, as pure
functions of the ledger's snapshot."""

from support import jobs

from sparrowrl.rollout.coordinator import Coordinator
from sparrowrl.trainer import reports


def row(version: int, **extra) -> dict:
    return {
        "version": version,
        "reward_mean": 0.25 * version,
        "loss": -0.5,
        "tokens": 96,
        "completion_tokens_mean": 3.0,
        "step_s": 2.0,
        "payload_bytes": 1234,
        "changed_fraction": 0.0125,
        **extra,
    }


def snapshot(rows: list[dict]) -> reports.Snapshot:
    c = Coordinator(4, 1, 10, staleness=1, steps=10, split="pull")
    c.publish(len(rows), "h")
    return reports.Snapshot(c.view(), 10, rows, 5.0, {"delta": 0, "base": 0}, 0, 0, False)


def samples(snap: reports.Snapshot) -> dict:
    return {
        (s.name, *s.labels.values()): s.value
        for family in reports.metrics(snap)
        for s in family.samples
        if s.name.startswith("sparrowrl_")
    }


def test_the_last_steps_reward_loss_kl_and_length_are_gauges_and_failed_rewards_add_up():
    rows = [
        row(1, reward_failed={"raised": 2}),
        row(2, kl=0.02, lr=3e-4, completion_tokens_mean=2.5, reward_failed={"raised": 1, "timeout": 4}),
    ]
    m = samples(snapshot(rows))
    assert m["sparrowrl_reward",] == 0.5 and m["sparrowrl_loss",] == -0.5 and m["sparrowrl_kl",] == 0.02
    assert m["sparrowrl_learning_rate",] == 3e-4 and m["sparrowrl_completion_tokens",] == 2.5
    assert m["sparrowrl_reward_failures_total", "raised"] == 3 and m["sparrowrl_reward_failures_total", "timeout"] == 4


def test_before_the_first_step_the_gauges_are_absent_not_zero():
    m = samples(snapshot([]))
    assert not {k for k in m if k[0] in ("sparrowrl_reward", "sparrowrl_loss", "sparrowrl_completion_tokens")}


def test_one_line_per_step_says_what_a_user_watches():
    line = reports.step_line(row(3, kl=0.0123, reward_failed={"timeout": 2}), 10)
    assert line.startswith("trainer: step 3/10 reward 0.750 loss -0.5000 kl 0.0123")
    assert "48 tok/s" in line and "payload 1,234 B (1.25% changed)" in line and "2.00 s" in line
    assert line.endswith("rewards failed 2")
    assert "kl" not in reports.step_line(row(3), 10) and "failed" not in reports.step_line(row(3), 10)


def test_the_stores_size_and_what_it_pruned_are_metrics_and_in_the_summary():
    """A user sees that the trainer's volume does not grow without bound."""
    from dataclasses import replace

    from sparrowrl.trainer.retention import Held

    snap = replace(snapshot([row(1, dense_bytes=4096)]), store=Held(pruned=30, versions=12, bytes=5_000_000))
    m = samples(snap)
    assert m["sparrowrl_store_pruned_versions_total",] == 30
    assert m["sparrowrl_store_versions",] == 12 and m["sparrowrl_store_bytes",] == 5_000_000
    s = reports.summary(snap)
    assert s["store_versions_pruned"] == 30 and s["store_bytes"] == 5_000_000
    assert not {k for k in samples(snapshot([])) if k[0].startswith("sparrowrl_store")}


def test_tokens_and_each_workers_leases_and_refused_answers_are_metrics():
    """What the dashboard's tokens per second, leases and refused answers panels read: from the
    trainer, so workers in member clusters that no Prometheus scrapes are on it too."""
    c = Coordinator(4, 1, 10, staleness=1, steps=10, split="pull")
    c.publish(0, "h0")
    assert "lease" in c.work("w1", 0, region="eu")
    c.commit("w1", 0, "h0", refused=2)
    c.commit("w2", 0, "h0")
    snap = reports.Snapshot(
        c.view(), 10, [row(1), row(2, tokens=4)], 5.0, {"delta": 0, "base": 0}, 1, 0, False, resumes=2
    )
    m = samples(snap)
    assert m["sparrowrl_tokens_total",] == 100
    # a restart (one died) and a resume (on purpose: --resume, raised steps) are told apart
    assert (m["sparrowrl_trainer_restarts_total",], m["sparrowrl_trainer_resumes_total",]) == (1, 2)
    s = reports.status(snap)
    assert (s.trainer_restarts, s.trainer_resumes) == (1, 2)
    assert m["sparrowrl_worker_leases", "w1"] == 1 and m["sparrowrl_worker_leases", "w2"] == 0
    assert (
        m["sparrowrl_worker_refused_answers_total", "w1"] == 2
        and m["sparrowrl_worker_refused_answers_total", "w2"] == 0
    )


def spec_with_prices(trainer: float | None, **placements: float | None):
    from sparrowrl.spec.job import parse

    return parse(
        jobs.job(
            trainer={} if trainer is None else {"costPerHour": trainer},
            placements=[{"region": r, **({} if p is None else {"costPerHour": p})} for r, p in placements.items()],
        )
    ).spec


def test_prices_come_from_the_trainer_and_each_placement_and_none_means_no_cost():
    from sparrowrl.trainer.cost import Rates

    assert Rates.of(spec_with_prices(None, us=None)) is None
    r = Rates.of(spec_with_prices(None, us=1.5, eu=None))
    assert r == Rates(0.0, {"us": 1.5})
    r = Rates.of(spec_with_prices(4.0, us=1.5, eu=0.5))
    # one item per live worker; a region of no placement (or a worker that named none) costs nothing
    assert r.per_hour([]) == 4.0 and r.per_hour(["us", "us", "eu", "ap", None]) == 4.0 + 1.5 + 1.5 + 0.5
    spec = spec_with_prices(4.0, us=1.5)
    spec = spec.model_copy(update={"trainer": spec.trainer.model_copy(update={"nodes": 3})})
    assert Rates.of(spec) == Rates(12.0, {"us": 1.5})  # a trainer of several nodes: a pod, and a price, per node


def test_cost_accrues_over_the_loops_time_at_the_rate_of_the_live_workers():
    from sparrowrl.trainer.cost import Meter, Rates, tokens_per_dollar

    m = Meter(Rates(2.0, {"us": 1.0, "eu": 3.0}))
    assert m.to(1800, []) == 1.0  # the trainer alone, waiting for workers: half an hour at $2
    assert m.to(3600, ["us", "eu"]) == 1.0 + 0.5 * 6.0  # then two workers live
    assert m.to(3600, ["us"]) == 4.0  # no time passed, nothing accrued
    assert m.to(3000, ["us"]) == 4.0 and m.at == 3600  # a clock read out of order adds nothing
    assert m.to(7200, ["us"]) == 4.0 + 3.0  # one worker lost
    assert tokens_per_dollar(700, 7.0) == 100.0 and tokens_per_dollar(700, 0.0) is None
    assert tokens_per_dollar(700, 1e-300) is None  # a price of 1e-300 is allowed; its ratio would overflow


def test_the_cost_and_tokens_per_dollar_are_in_the_status_metrics_and_summary_when_priced():
    from dataclasses import replace

    unpriced = snapshot([row(1, dense_bytes=4096), row(2, dense_bytes=4096)])
    assert unpriced.dollars is None and reports.status(unpriced).tokens_per_dollar is None
    assert "cost_dollars" not in reports.summary(unpriced)
    assert not {k for k in samples(unpriced) if k[0] in ("sparrowrl_cost_dollars_total", "sparrowrl_tokens_per_dollar")}

    priced = replace(unpriced, dollars=0.48)
    s = reports.status(priced)
    assert s.cost_dollars == 0.48 and s.tokens_per_dollar == 192 / 0.48
    m = samples(priced)
    assert m["sparrowrl_cost_dollars_total",] == 0.48 and m["sparrowrl_tokens_per_dollar",] == 400
    summary = reports.summary(priced)
    assert summary["cost_dollars"] == 0.48 and summary["tokens_per_dollar"] == 400

    free = replace(unpriced, dollars=0.0)  # prices of 0, or nothing run yet: no division by zero
    assert reports.status(free).tokens_per_dollar is None and samples(free)["sparrowrl_cost_dollars_total",] == 0
