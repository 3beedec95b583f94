"""The trainer process (`sparrowrl trainer`): the learner, the checkpoint store's server, the
control plane that workers call, and the training loop that joins them. Its state dir holds
what it needs to go on after a kill (resume.py).

One step: take a complete batch from the coordinator → the learner's GRPO step → publish the
version's delta into the store (served as it is written) → record its row → prune what no one
needs from the store (retention.py) → every `trainer.checkpoint.every` steps, a checkpoint,
written while the next steps train; once it is whole, the journal starts again from it
(resume.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Callable

from aiohttp import web

from sparrowrl.auth.signing import Signer
from sparrowrl.rollout.coordinator import Coordinator
from sparrowrl.rollout.evals import Evals
from sparrowrl.spec import messages
from sparrowrl.spec.job import JobSpec
from sparrowrl.store.store import Store
from sparrowrl.trainer import cost, journal, ledger, reports, resume, retention
from sparrowrl.trainer.control import Control
from sparrowrl.trainer.learner import Learner
from sparrowrl.trainer.outputs import Outputs
from sparrowrl.trainer.rendezvous import Gang
from sparrowrl.transport.http import ServingTLS, add_health, freeze_heap, listen, more_open_files
from sparrowrl.transport.metrics import add_metrics
from sparrowrl.transport.server import SENT, make_app

log = logging.getLogger(__name__)


class Trainer:
    """One trainer process on its state dir: a fresh one, or the next after a kill."""

    def __init__(self, spec: JobSpec, state_dir: Path, token: str, gang: Gang | None = None):
        self.spec, self.state_dir, self.token = spec, state_dir, token
        self.learner = Learner(spec, state_dir, gang)
        s = spec.rollout
        self.coord = Coordinator(
            spec.grpo.prompts_per_step,
            s.groups_per_lease,
            s.lease_seconds,
            spec.sync.staleness,
            spec.steps,
            s.split,
            quorum=spec.quorum,
            refill=spec.grpo.refill_groups,
        )
        for v, entry in self.store.versions.items():
            self.coord.publish(v, entry.state_hash, self.learner.published(v)["payload_bytes"])
        e = spec.task.eval
        self.evals = None if e is None else Evals(e.prompts, e.every, spec.steps, s.groups_per_lease, s.lease_seconds)
        if self.evals is not None:
            self.evals.open(self.store.newest)  # v0's round, or the round due at a restart's newest
        self.control = Control(spec, self.learner, self.coord, self._journal, self.evals)
        self.ledger = ledger.Ledger(state_dir, self.learner, cost.Rates.of(spec))
        self.sent = {"delta": 0, "base": 0}  # what this process's origin sent (its server counts)
        self.outputs = Outputs(spec, state_dir)
        self.trained: journal.Results = {}  # results of batches trained since the newest whole checkpoint
        self.writing: asyncio.Task | None = None  # the checkpoint being written
        self._resume()
        self.journal = journal.Journal(state_dir / "journal.jsonl")
        self._compact()  # also drops a line a crash cut short

    def _resume(self) -> None:
        """Take over from the previous trainer process on this state dir, if there was one."""
        path = self.state_dir / "journal.jsonl"
        state, results = journal.read(path, self.spec.steps)
        planned = resume.take_planned(self.state_dir)
        version = self.learner.version
        if state is None:
            if self.store.newest:  # the results of the steps since the checkpoint are gone
                raise resume.ResumeError(f"{path}: missing, and the store is at v{self.store.newest}")
            return
        self.coord.restore(state["coordinator"], taken=version, results=results)
        book = self.ledger
        book.restore(state["ledger"], planned)
        why = f"planned resume {book.resumes}" if book.planned else f"restart {book.restarts}"
        log.info(
            f"trainer: resumed at v{version} ({why}), {len(self.coord.leases())} leases "
            f"live, {sum(map(len, self.coord.untrained().values()))} groups admitted for coming steps"
        )

    @property
    def store(self) -> Store:
        """The learner's store: this process is rank 0, which holds it."""
        assert self.learner.store is not None
        return self.learner.store

    def _state(self) -> dict:
        """What the journal's snapshot keeps besides admitted results (see resume.py)."""
        return {"coordinator": self.coord.state(), "ledger": self.ledger.state(self.sent)}

    def _results(self, groups: tuple[int, list[int]] | None = None) -> journal.Results:
        """Admitted results of the batches not yet trained, and of those trained since the newest
        checkpoint (a restart trains them again); or of `groups` (batch, its groups)."""
        if groups is None:
            return {**self.trained, **self.coord.untrained()}
        b, gs = groups
        return {b: self.coord.results(b, gs)} if gs else {}

    def _compact(self) -> None:
        """A new journal from a snapshot: the changes so far are in it, and the results that the
        newest checkpoint does not hold."""
        saved = self.learner.saved.newest()
        assert saved is not None  # the learner checkpoints v0 before anything
        self.trained = {b: r for b, r in self.trained.items() if b >= saved}
        self.coord.changes()
        self.journal.compact(self._state(), self._results())

    def _journal(self, admitted: tuple[int, list[int]] | None) -> None:
        """Every change, before the request that made it is answered, with the results it
        admitted: only those (the snapshot and earlier lines hold the rest), so a line's size does
        not grow with the results held."""
        self.ledger.flush(self.coord)
        self._meter()
        self.journal.append(
            {"coordinator": self.coord.changes(), "ledger": self.ledger.state(self.sent, whole=False)},
            None if admitted is None else self._results(admitted),
        )

    def _meter(self) -> None:
        self.ledger.meter(lambda: [self.coord.fleet.region_of(w) for w in self.coord.fleet.live()])

    def snapshot(self) -> reports.Snapshot:
        self._meter()
        return self.ledger.snapshot(self.coord.view(), self.spec.steps, self.sent)

    async def h_status(self, request: web.Request) -> web.Response:
        return web.json_response(reports.status(self.snapshot()).model_dump())

    def app(
        self, metrics_port: int | None = None, host: str = "127.0.0.1", served: ServingTLS | None = None
    ) -> web.Application:
        app = make_app(
            self.store.path,
            self.token,
            max_body=messages.max_body(self.spec.lease_tokens),
            signer=Signer(self.token) if self.token else None,  # the trainer vouches for its versions
            written_here=True,  # the learner's store tells the server of each new version
        )
        self.sent = app[SENT]
        app.add_routes([*self.control.routes(), web.get("/v1/status", self.h_status)])
        add_health(app, lambda: self.coord.published >= 0)  # serving version 0 and taking work
        add_metrics(
            app,
            lambda: reports.metrics(self.snapshot()),
            None if metrics_port is None else (host, metrics_port),
            served,
        )
        return app

    async def train_loop(self) -> None:
        """From the version the learner holds (0, or where a previous process stopped) to the last.
        Steps the store is already past (trained after the newest checkpoint, before a kill) are
        trained again on the same admitted results, and not published again: their versions stay
        as they were; the next version is diffed from the store's newest (resume.py)."""
        control, learner, book = self.control, self.learner, self.ledger
        book.start_loop()
        book.flush(self.coord)
        store = self.store
        published = store.newest
        if published > learner.version:
            log.info(
                f"trainer: the newest checkpoint is v{learner.version}, the newest version v{published}: "
                f"training steps {learner.version + 1}..{published} again from the journal"
            )
        every = self.spec.trainer.checkpoint.every
        scoring = asyncio.create_task(self._score_admitted()) if self.coord.refill else None
        for b in range(learner.version, self.spec.steps):
            t0 = time.perf_counter()
            while (batch := self.coord.take(b)) is None:
                self.coord.expire()
                if scoring is not None and scoring.done():
                    scoring.result()  # what stopped it, raised here: the batch waits for its scores
                await control.until_changed(0.2)  # a result admitted, or time to expire leases
            control.changed()
            self.trained[b] = batch.results
            wait = time.perf_counter() - t0
            done = batch.done
            assert done is not None  # a batch taken is complete
            m = await asyncio.to_thread(learner.train, batch)
            self._warn(b, batch, m)
            generate_s = batch.worker_seconds / max(1, len(self.coord.fleet.live()))
            partial = {
                "version": b + 1,
                "step": b,
                **m,
                "completion_tokens_mean": m["tokens"] / (len(batch.groups) * self.spec.grpo.group_size),
                "generate_s": generate_s,
                "wait_s": wait,
                "rollout_s": done - (batch.opened or done),
            }
            if b + 1 <= published:  # trained again: its version is out already
                book.trained_again(partial, time.perf_counter() - t0)
                if b + 1 == published:
                    same = await asyncio.to_thread(learner.holds, published)
                    log.info(
                        f"trainer: trained again to v{published}: "
                        + (
                            "the same bits as published"
                            if same
                            else f"not the bits published (v{published + 1} moves the workers to them)"
                        )
                    )
            else:
                extract_s = await asyncio.to_thread(learner.publish)
                self.coord.publish(b + 1, store.versions[b + 1].state_hash, learner.published(b + 1)["payload_bytes"])
                if self.evals is not None:
                    self.evals.open(b + 1)
                book.record(partial, extract_s, time.perf_counter() - t0)
                self._journal(None)  # the row, before the next step: a restart records only the newest again
                log.info(reports.step_line(book.rows[b + 1], self.spec.steps))
                self.outputs.step(book.rows[b + 1])
                oldest = retention.needed(store, self.coord, self.outputs.exporting)
                book.pruned(await asyncio.to_thread(retention.prune, store, oldest))
            if (b + 1) % every == 0 or b + 1 == self.spec.steps:
                await self._checkpoint()
            await self._score_evals()
            control.changed()
        if scoring is not None:
            scoring.cancel()
        if self.writing is not None:
            await self.writing
        # every worker should still commit and verify the final version
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
            self.coord.fleet.behind(self.spec.steps) or (self.evals is not None and self.evals.waiting(self.spec.steps))
        ):
            await control.until_changed(deadline - time.monotonic())
        if self.evals is not None:
            self.evals.close()
            await self._score_evals()
        book.flush(self.coord, final=True)
        self.outputs.close()
        learner.save(self.state_dir / "final")
        learner.stop()
        summary = {**reports.summary(self.snapshot()), "mode": self.spec.sync.mode}
        (self.state_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        book.finish()
        control.changed()

    async def _score_admitted(self) -> None:
        """With refills on: score each admitted group as it comes, so that the coordinator can
        replace one that teaches nothing while its batch is still generated (and the step finds
        its rewards ready)."""
        while True:
            todo = self.coord.unscored()
            if not todo:
                await self.control.until_changed(1.0)
                continue
            b, groups = todo[0]
            results = self.coord.results(b, groups)
            scores = await asyncio.to_thread(self.learner.score, results)
            self.coord.scored(b, scores)
            self.control.changed()

    async def _score_evals(self) -> None:
        """Score the eval rounds that are complete (or closed), between steps: the reward's
        processes are the learner's, which is not training now."""
        for r in self.evals.ready() if self.evals is not None else []:
            row = await asyncio.to_thread(self.learner.evaluate, r.version, r.results)
            self.ledger.record_eval(row)
            k = f", pass@{row['samples']} {row['pass_at_k']:.3f}" if "pass_at_k" in row else ""
            log.info(
                f"trainer: eval v{row['version']}: pass@1 {row['pass_at_1']:.3f}{k} reward {row['reward_mean']:.3f} "
                f"({row['prompts']} prompts x {row['samples']}, {row['decoding']})"
            )

    def _warn(self, b: int, batch, m: dict) -> None:
        """A step that changed no weight, with the leases that fed it; samples refused, by worker;
        a step whose refills ran out before it had promptsPerStep groups that vary."""
        g = self.spec.grpo
        if g.refill_groups and m["refill_groups"] == g.refill_groups:
            if (varied := m["groups_varied"]) < g.prompts_per_step:
                log.warning(
                    f"trainer: step {b + 1} trains on {varied} of {g.prompts_per_step} groups that vary: it drew "
                    f"{m['refill_groups']} more in place of those whose samples all scored alike, the most "
                    f"grpo.maxGenBatches ({g.max_gen_batches}) allows"
                )
        if m["skipped"]:
            fed = sorted({(r.get("lease", -1), r.get("worker", "unknown")) for r in batch.results.values()})
            log.warning(
                f"trainer: no weight changed at step {b + 1} ({m['skipped']}); its leases: "
                + ", ".join(f"{lease} of {worker}" for lease, worker in fed)
            )
        for worker, reasons in m["refused_samples"].items():
            gap = m["by_worker"].get(worker, {}).get("mismatch_mean")
            why = ", ".join(f"{n} {w}" for w, n in reasons.items())
            log.warning(
                f"trainer: refused {sum(reasons.values())} samples of worker {worker} at step {b + 1} ({why})"
                + (f"; its log-probs are {gap:.3g} nats per token from the trainer's on average" if gap else "")
            )

    async def _checkpoint(self) -> None:
        """Checkpoint the learner's weights; the write goes on beside the next steps (one at a
        time: one copy of the weights in memory), and the journal starts again from it once it is
        whole."""
        if self.writing is not None:
            await self.writing
        write = await asyncio.to_thread(self.learner.checkpoint)

        async def finish() -> None:
            await asyncio.to_thread(write)
            self._compact()

        self.writing = asyncio.create_task(finish())


def starting_app() -> web.Application:
    """What answers on the trainer's port while it loads its model and writes v0 (minutes for a
    large model): /healthz says the process lives, so a liveness probe does not kill it; /readyz
    and everything else answer 503 with Retry-After, which workers wait on."""

    async def starting(request: web.Request) -> web.Response:
        return web.Response(status=503, headers={"Retry-After": "2"}, text="trainer: starting (loading the model)")

    app = web.Application()
    add_health(app, lambda: False)
    app.router.add_route("*", "/{tail:.*}", starting)
    return app


async def serve(
    spec: JobSpec,
    state_dir: Path,
    host: str,
    port: int,
    token: str,
    metrics_port: int | None = None,
    check: Callable[[], None] | None = None,
    served: ServingTLS | None = None,
    gang: Gang | None = None,
) -> None:
    """`gang`: where a trainer of several nodes meets them (node 0's part). `check`: the job's data
    and reward read and checked, answering /healthz meanwhile (a large data set takes minutes,
    which no probe of the pod can know in advance). `served`: HTTPS."""
    more_open_files("trainer")  # a long poll per worker
    early = web.AppRunner(starting_app())
    await early.setup()
    await listen(early, host, port, served)
    log.info(f"trainer: starting on {host}:{port}")
    try:
        if check is not None:
            await asyncio.to_thread(check)
        run = await asyncio.to_thread(Trainer, spec, state_dir, token, gang)
        freeze_heap()  # what the model and the modules hold, out of the collector's passes
    finally:
        await early.cleanup()  # the port is free again, for the trainer's own server at once
    runner = web.AppRunner(run.app(metrics_port, host, served))
    await runner.setup()
    await listen(runner, host, port, served)
    log.info(f"trainer: serving on {'https' if served else 'http'}://{host}:{port}")
    try:
        await run.train_loop()
        await asyncio.sleep(2.0)  # let workers see `finished` and the runner read the summary
    finally:
        await runner.cleanup()
