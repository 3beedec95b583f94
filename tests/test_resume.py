"""A trainer started again on its state dir: each moment a kill can fall on, taken in turn.
The end-to-end kill -9 under the runner is in test_run.py."""

import asyncio
import json
import time

import pytest
import torch
from test_control import SPEC, serve

from sparrowrl.spec.job import parse
from sparrowrl.spec.statedir import PLANNED_RESUME
from sparrowrl.store.store import Store
from sparrowrl.trainer import journal
from sparrowrl.trainer.resume import ResumeError
from sparrowrl.trainer.trainer import Trainer
from sparrowrl.transport.client import Client

pytestmark = pytest.mark.timeout(300)
JOB = parse(SPEC).spec


def died(run: Trainer) -> Trainer:
    """What a process's death does to what it holds: the kernel closes its files, and its lock
    on the state dir goes (the objects are never used again)."""
    run.learner.held.close()
    run.journal.close()
    return run


def restart(run: Trainer) -> Trainer:
    """The same command again, on the state dir of a trainer that was killed."""
    died(run)
    return Trainer(JOB, run.state_dir, token="")


def results(lease: dict, token: int = 3) -> dict:
    return {str(p["group"]): {"samples": [{"tokens": [token], "logprobs": [-1.0]}] * 2} for p in lease["prompts"]}


def body(run: Trainer, lease: dict, token: int = 3) -> dict:
    return {
        "lease": lease["id"],
        "worker": "w",
        "version": 0,
        "state_hash": run.coord.hash_of(0),
        "results": results(lease, token),
        "generate_s": 0.1,
    }


async def over_http(run: Trainer, calls):
    runner, port = await serve(run)
    try:
        async with Client(f"http://127.0.0.1:{port}", attempts=2, backoff=0.01) as c:
            return await calls(c)
    finally:
        await runner.cleanup()


def step(run: Trainer) -> dict:
    """Batch 0 from two leases over HTTP, then the optimizer step, published: the moment a kill
    leaves the store one version ahead of the checkpoint."""

    async def calls(c):
        for _ in range(2):
            lease = (await c.post_json("/v1/work", {"worker": "w", "version": 0}))["lease"]
            assert (await c.post_json("/v1/results", body(run, lease)))["admitted"] == 1

    asyncio.run(over_http(run, calls))
    batch = run.coord.take(0)
    run.trained[0] = batch.results
    run.control.changed()
    m = run.learner.train(batch)
    run.learner.publish()
    return m


def test_killed_after_publishing_before_its_checkpoint_it_trains_the_step_again(tmp_path):
    """The checkpoint is never ahead of the store. A trainer killed after it published v1, before
    its checkpoint of v1, starts from v0's checkpoint with batch 0's admitted results from the
    journal (trained, so not in the coordinator's queue, but kept for this), trains step 1 again
    to the same bits as v1, and diffs its next version from the store's v1. Nothing published is
    written again."""
    killed = Trainer(JOB, tmp_path / "killed", token="")
    m = step(killed)
    published = killed.learner.store.versions[1]
    again = restart(killed)
    assert again.learner.version == 0 and again.learner.store.newest == 1 and again.coord.taken == 0
    batch = again.coord.take(0)
    assert batch is not None and batch.results == killed.trained[0]  # the results it trained on, from the journal
    assert again.learner.train(batch)["reward_mean"] == m["reward_mean"] and again.learner.version == 1
    assert again.learner.holds(1)  # the same bits as the v1 workers hold
    v1 = again.learner.store.materialize(1)
    assert all(torch.equal(again.learner.publisher.policy[n][1], t.reshape(-1)) for n, t in v1.items())
    assert (again.learner.store.versions[1].state_hash, again.learner.store.versions[1].delta_sha256) == (
        published.state_hash,
        published.delta_sha256,
    )
    (tmp_path / "killed" / "journal.jsonl").unlink()  # a state dir that lost its journal is not guessed at
    with pytest.raises(ResumeError, match=r"journal.jsonl: missing, and the store is at v1"):
        restart(again)


def test_a_step_trained_again_to_other_bits_and_checkpointed_still_resumes(tmp_path):
    """Where training is not deterministic (a GPU, a reward that times out), a step trained again
    after a restart can come to other bits than the version it had published, and be checkpointed
    so. Started again, the trainer diffs from the store's version (what workers hold), not from
    its checkpoint's cast, and its next version moves the workers to its weights."""
    run = Trainer(JOB, tmp_path, token="")
    step(run)
    with torch.no_grad():
        next(run.learner.model.parameters()).add_(0.5)  # the same step, to other bits
    assert not run.learner.holds(1)
    run.learner.checkpoint()()
    again = restart(run)
    assert again.learner.version == again.learner.store.newest == 1 and not again.learner.holds(1)
    v1 = again.learner.store.materialize(1)
    assert all(torch.equal(again.learner.publisher.policy[n][1], t.reshape(-1)) for n, t in v1.items())
    again.learner.publish()  # as if after its next step
    assert again.learner.holds(2)


def test_a_checkpoint_is_written_beside_the_next_step_and_the_newest_are_kept(tmp_path):
    """The copy is taken when the checkpoint is asked for: the write that runs later holds those
    weights, whatever the model has become since. The newest `keep` stay."""
    spec = parse({**SPEC, "spec": {**SPEC["spec"], "trainer": {"checkpoint": {"every": 2, "keep": 2}}}}).spec
    run = Trainer(spec, tmp_path, token="")
    learner = run.learner
    writes = []
    for v in (1, 2, 3):
        learner.version = v
        writes.append((learner.checkpoint(), {n: p.detach().clone() for n, p in learner.model.named_parameters()}))
        with torch.no_grad():
            for p in learner.model.parameters():
                p.add_(1.0)  # the next step
    for write, _ in writes:
        write()
    assert sorted(p.name for p in (tmp_path / "trainer").glob("v*")) == [
        "v00000002.safetensors",
        "v00000003.safetensors",
    ]
    learner.saved.load(2, learner.model, learner.opt)
    assert all(torch.equal(p, writes[1][1][n]) for n, p in learner.model.named_parameters())


def test_admitted_results_and_live_leases_survive_and_count_once(tmp_path):
    """Admitted results are journaled before they are answered, live leases too: after a
    restart the results are there (not generated again), a lease handed out before is still
    the worker's, a retried delivery (its answer lost in the kill) gets the first answer and
    counts once, and no lease id is handed out again."""
    first = Trainer(JOB, tmp_path, token="")

    async def before(c):
        a = (await c.post_json("/v1/work", {"worker": "w", "version": 0}))["lease"]
        b = (await c.post_json("/v1/work", {"worker": "w", "version": 0}))["lease"]
        assert (await c.post_json("/v1/results", body(first, a)))["admitted"] == 1
        return a, b

    a, b = asyncio.run(over_http(first, before))
    (tmp_path / "journal.jsonl").open("a").write('{"results": {"0": {"1": ')  # a write the kill cut short
    again = restart(first)
    assert again.coord.batch(0).results[a["groups"][0]]["samples"][0]["tokens"] == [3]
    assert [x.id for x in again.coord.leases()] == [b["id"]] and again.coord.batch(0).pending == []

    async def after(c):
        got = [
            await c.post_json("/v1/results", body(again, b, token=4)),
            await c.post_json("/v1/results", body(again, a, token=5)),
        ]  # a retry the first process answered
        return got, await c.post_json("/v1/work", {"worker": "w", "version": 0})

    (got_b, got_a), nxt = asyncio.run(over_http(again, after))
    assert got_b["admitted"] == 1 and got_a == {"admitted": 1, "batch": 0}
    c = again.coord.counts
    assert (c.admitted, c.discarded_late) == (2, 0)
    assert again.coord.batch(0).results[a["groups"][0]]["samples"][0]["tokens"] == [3]  # the first delivery stays
    assert nxt["lease"]["id"] > b["id"] and nxt["lease"]["batch"] == 1


def test_a_damaged_journal_line_is_refused_with_its_line(tmp_path):
    died(Trainer(JOB, tmp_path, token=""))
    path = tmp_path / "journal.jsonl"
    snapshot = path.read_text()
    path.write_text("not json\n" + snapshot)
    with pytest.raises(ResumeError, match=r"journal.jsonl: line 1 is damaged \(not JSON\)"):
        journal.read(path, JOB.steps)
    path.write_text(snapshot + '{"events": {"coordinator": [["drop", 1]]}, "results": {}}\n' + snapshot)
    with pytest.raises(ResumeError, match=r"journal.jsonl: line 2 is damaged \(KeyError: 'ledger'\)"):
        journal.read(path, JOB.steps)
    path.write_text(snapshot.replace('{"format": 2,', '{"format": 3,'))
    with pytest.raises(ResumeError, match=r"journal format 3, this trainer reads 1..2: a newer sparrowrl wrote it"):
        journal.read(path, JOB.steps)
    (tmp_path / "journal.jsonl").unlink()
    died(Trainer(JOB, tmp_path, token=""))  # killed before its first journal line: a start from v0 again


def test_a_journal_line_does_not_grow_with_the_workers(tmp_path):
    """Each request journals its own changes, not the whole state: with 2,000 workers known, a
    commit's line is as short as with one."""
    run = Trainer(JOB, tmp_path, token="")
    h0 = run.coord.hash_of(0)
    sizes = []
    for n in range(2000):
        run.coord.commit(f"w{n}", 0, h0)
        run.control.changed()
        sizes.append(len((tmp_path / "journal.jsonl").read_text().splitlines()[-1]))
    assert sizes[-1] < 1000 and sizes[-1] - sizes[0] < 20, (sizes[0], sizes[-1])
    again = restart(run)  # and every commit is still there after a restart
    assert len(again.coord.state()["commits"]) == 2000 and again.coord.counts.verified == 2000
    assert len(again.coord.fleet.live()) == 2000  # awaited, while they back off through the trainer's absence


def test_a_journal_line_carries_only_the_results_it_admitted(tmp_path):
    """Admitted results are journaled once, on the line of the request that admitted them: the
    lines of later requests (a thousand commits a step with a thousand workers) do not carry them
    again, so a step's journal grows with its requests, not with requests times results."""
    run = Trainer(JOB, tmp_path, token="")

    async def deliver(c):
        lease = (await c.post_json("/v1/work", {"worker": "w", "version": 0}))["lease"]
        assert (await c.post_json("/v1/results", body(run, lease)))["admitted"] == 1

    asyncio.run(over_http(run, deliver))
    line = json.loads((tmp_path / "journal.jsonl").read_text().splitlines()[-1])
    assert line["results"] == {"0": {"0": line["results"]["0"]["0"]}}  # the admitting line: its group only
    run.coord.commit("w", 0, run.coord.hash_of(0))
    run.control.changed()
    assert json.loads((tmp_path / "journal.jsonl").read_text().splitlines()[-1])["results"] == {}
    again = restart(run)  # and the result is still there after a restart
    assert list(again.coord.batch(0).results) == [0]


def test_restarts_are_counted_and_cut_writes_swept(tmp_path):
    """Every process that started counts, also one killed before it journaled anything; the
    temporary folders of writes a kill cut short are removed (only ours, by their names)."""
    for _ in range(3):
        run = died(Trainer(JOB, tmp_path, token=""))
    assert run.ledger.restarts == 2
    cut = tmp_path / "trainer" / ".v00000001.safetensors.k2x_9abc"  # as atomic_path names it
    stranger = tmp_path / "trainer" / ".notes.k2x_9abc"
    for d in (cut, stranger):
        d.mkdir()
        (d / "f").write_bytes(b"x" * 1000)
    again = Trainer(JOB, tmp_path, token="")
    assert again.ledger.restarts == 3 and not cut.exists() and (stranger / "f").exists()


def test_a_planned_resume_is_not_a_restart(tmp_path):
    """A trainer started on its state dir to go on (its job's steps raised, as `sparrowrl run
    --resume --steps` and a cluster's edited job do, or after its predecessor finished) counts in
    `resumes`; only one started after a trainer died counts in `restarts`."""
    died(Trainer(JOB, tmp_path, token=""))  # killed: the next is a restart
    run = died(Trainer(JOB, tmp_path, token=""))
    assert (run.ledger.restarts, run.ledger.resumes) == (1, 0)
    more = parse({**SPEC, "spec": {**SPEC["spec"], "steps": 3}}).spec
    run = Trainer(more, tmp_path, token="")
    assert (run.ledger.restarts, run.ledger.resumes, run.ledger.planned) == (1, 1, True)
    run = Trainer(more, died(run).state_dir, token="")  # the raise was journaled: this one is a restart
    assert (run.ledger.restarts, run.ledger.resumes, run.ledger.planned) == (2, 1, False)
    run.ledger.finished = True  # as the end of the training loop journals it
    run.control.changed()
    run = Trainer(more, died(run).state_dir, token="")
    assert (run.ledger.restarts, run.ledger.resumes, run.ledger.planned) == (2, 2, True)
    snap = run.snapshot()
    assert (snap.restarts, snap.resumes) == (2, 2)
    (tmp_path / PLANNED_RESUME).write_text("sparrowrl run --resume\n")  # a stopped run, the same steps
    run = Trainer(more, died(run).state_dir, token="")
    assert (run.ledger.restarts, run.ledger.resumes, run.ledger.planned) == (2, 3, True)
    assert not (tmp_path / PLANNED_RESUME).exists()  # taken as it starts: a trainer dying after it is restarted
    run = Trainer(more, died(run).state_dir, token="")
    assert (run.ledger.restarts, run.ledger.resumes, run.ledger.planned) == (3, 3, False)


def test_a_stale_partial_delta_is_removed(tmp_path):
    """A delta a killed trainer was writing would keep its readers waiting: gone on restart."""
    died(Trainer(JOB, tmp_path, token=""))
    partial = Store(tmp_path / "store").partial_path(1)
    partial.write_bytes(b"half a delta")
    assert Store(tmp_path / "store").producing() == [1]
    again = Trainer(JOB, tmp_path, token="")
    assert again.learner.store.producing() == [] and not partial.exists()


def test_another_jobs_state_a_stranger_folder_or_a_second_trainer_is_refused(tmp_path):
    running = Trainer(JOB, tmp_path / "a", token="")
    with pytest.raises(ResumeError, match=r"another trainer is running on it"):
        Trainer(JOB, tmp_path / "a", token="")
    died(running)
    fewer = parse({**SPEC, "spec": {**SPEC["spec"], "steps": 1}}).spec
    with pytest.raises(ResumeError, match=r"another job \(spec\.steps is 1, below the 2 it was made for\)"):
        Trainer(fewer, tmp_path / "a", token="")
    other = parse({**SPEC, "spec": {**SPEC["spec"], "grpo": {**SPEC["spec"]["grpo"], "learningRate": 0.5}}}).spec
    with pytest.raises(ResumeError, match=r"holds the state of another job \(spec\.grpo differs\)"):
        Trainer(other, tmp_path / "a", token="")
    (tmp_path / "b" / "store").mkdir(parents=True)
    (tmp_path / "b" / "store" / "theirs.txt").write_text("not ours")
    with pytest.raises(ResumeError, match=r"holds 'store' but no job.json: not a trainer's state"):
        Trainer(JOB, tmp_path / "b", token="")
    assert (tmp_path / "b" / "store" / "theirs.txt").read_text() == "not ours"
    assert json.loads((tmp_path / "a" / "job.json").read_text())["steps"] == 2


def test_a_format_1_journal_is_read(tmp_path):
    """A trainer upgraded in the middle of a job reads its predecessor's journal of format 1,
    which kept the workers' regions, first commits and generation seconds under "control", named
    a count "duplicated", had no refills, and a ledger without five of today's keys."""
    run = Trainer(JOB, tmp_path, token="")

    async def calls(c):
        lease = (await c.post_json("/v1/work", {"worker": "w", "version": 0, "region": "eu"}))["lease"]
        await c.post_json("/v1/results", body(run, lease))
        await c.post_json("/v1/commit", {"worker": "w", "version": 0, "state_hash": run.coord.hash_of(0)})

    asyncio.run(over_http(run, calls))
    path = tmp_path / "journal.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    keys = ("begun", "regions", "first", "worker_seconds")
    old = {k: lines[0]["snapshot"]["coordinator"].pop(k) for k in keys}
    old["gen"] = old.pop("worker_seconds")
    lines[0]["snapshot"]["control"] = old
    assert lines[0].pop("format") == 2
    del lines[0]["snapshot"]["coordinator"]["refills"]
    for line in lines:
        for key in ("redone", "finished", "steps", "resumes", "dollars"):
            (line.get("snapshot") or line["events"])["ledger"].pop(key, None)
    duplicated = lines[0]["snapshot"]["coordinator"]["counts"]
    duplicated["duplicated"] = duplicated.pop("discarded_late") + 3  # as if 3 had been dropped
    for line in lines[1:]:
        events = line["events"]
        for e in events["coordinator"]:
            if e[0] == "counts":
                e[1]["duplicated"] = e[1].pop("discarded_late") + 3
        moved = [e for e in events["coordinator"] if e[0] in keys]
        events["coordinator"] = [e for e in events["coordinator"] if e[0] not in keys]
        events["control"] = [["gen", *e[1:]] if e[0] == "worker_seconds" else e for e in moved]
    assert any(line["events"]["control"] for line in lines[1:])  # the old journal has something to fold in
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    again = restart(run)
    c = again.coord
    s = c.state()
    assert (s["begun"], s["regions"], s["first"], c.batch(0).worker_seconds) == (True, {"w": "eu"}, {"w": 0}, 0.1)
    assert (c.counts.discarded_late, c.counts.admitted, s["refills"]) == (3, 1, {})
    assert (again.ledger.restarts, again.ledger.resumes, again.ledger.redone) == (1, 0, 0)
    assert json.loads(path.read_text().splitlines()[0])["format"] == 2  # compacted into today's format


def test_the_jobs_cost_is_carried_on_by_a_restarted_trainer(tmp_path):
    """What the job has cost is journaled with the loop's time: a trainer started again goes on
    from it, not from zero (docs/operator.md, Cost)."""
    spec = {k: v for k, v in SPEC["spec"].items() if k != "topology"}
    spec |= {"trainer": {"costPerHour": 3.6}, "placements": [{"region": "a", "costPerHour": 36.0}]}
    job = parse({**SPEC, "spec": spec}).spec
    run = Trainer(job, tmp_path, token="")
    run.ledger.t_loop = time.perf_counter() - 100  # as if its training loop had run 100 s
    run.coord.work("w", 0, region="a")  # a worker of placement a calls in, and commits v0
    run.coord.commit("w", 0, run.coord.hash_of(0))
    run.control.changed()  # journaled
    spent = run.snapshot().dollars
    assert spent == pytest.approx(100 * (3.6 + 36.0) / 3600, rel=1e-3)
    again = Trainer(job, died(run).state_dir, token="")
    assert again.snapshot().dollars == pytest.approx(spent, rel=1e-3)  # its loop has not started yet
    again.ledger.t_loop = time.perf_counter() - 10
    assert again.snapshot().dollars == pytest.approx(spent + 10 * (3.6 + 36.0) / 3600, rel=1e-3)  # w is awaited
