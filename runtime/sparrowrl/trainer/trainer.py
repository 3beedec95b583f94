"""The trainer process (`sparrowrl trainer`): the learner, the checkpoint store's server, the
control plane that workers call, and the training loop that joins them. Its state dir holds
what it needs to go on after a kill (resume.py).

One step: take a complete batch from the coordinator → the learner's GRPO step → checkpoint →
publish the version's delta into the store (served as it is written) → record its row."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from aiohttp import web

from sparrowrl.auth.signing import Signer
from sparrowrl.rollout.coordinator import Coordinator
from sparrowrl.spec import messages
from sparrowrl.spec.job import JobSpec
from sparrowrl.trainer import resume
from sparrowrl.trainer.control import Control
from sparrowrl.trainer.learner import Learner
from sparrowrl.trainer.ledger import Ledger
from sparrowrl.transport.http import add_health, listen
from sparrowrl.transport.metrics import add_metrics
from sparrowrl.transport.server import SERVED, make_app


class Trainer:
    """One trainer process on its state dir: a fresh one, or the next after a kill."""

    def __init__(self, spec: JobSpec, state_dir: Path, token: str):
        self.spec, self.state_dir, self.token = spec, state_dir, token
        self.learner = Learner(spec, state_dir)
        s = spec.rollout
        self.coord = Coordinator(
            spec.grpo.prompts_per_step, s.groups_per_lease, s.lease_seconds, spec.sync.staleness, spec.steps, s.split
        )
        for v, entry in self.learner.store.versions.items():
            self.coord.publish(v, entry.state_hash, self.learner.published(v)["payload_bytes"])
        self.control = Control(spec, self.learner, self.coord, self._journal)
        self.ledger = Ledger(spec, state_dir, self.learner, self.control)
        self._resume()
        self.journal = resume.Journal(state_dir / "journal.jsonl")
        self._compact()  # also drops a line a crash cut short

    def _resume(self) -> None:
        """Take over from the previous trainer process on this state dir, if there was one."""
        path = self.state_dir / "journal.jsonl"
        state, results = resume.Journal.read(path, self.replay)
        version = self.learner.version
        if state is None:
            if version:
                raise resume.ResumeError(f"{path}: missing, and the checkpoint is at v{version}")
            return
        self.coord.restore(state["coordinator"], taken=version, results=results)
        self.control.restore(state["control"], taken=version)
        self.ledger.restore(state["ledger"])
        print(
            f"trainer: resumed at v{version} (restart {self.ledger.restarts}), {len(self.coord.leases)} leases "
            f"live, {sum(len(b.results) for b in self.coord.batches.values())} groups admitted for coming steps",
            flush=True,
        )

    def _state(self) -> dict:
        """What the journal's snapshot keeps besides admitted results (see resume.py)."""
        return {"coordinator": self.coord.state(), "control": self.control.state(), "ledger": self.ledger.state()}

    @staticmethod
    def replay(state: dict, events: dict) -> None:
        """Apply one journal line's events to a snapshot (`resume.Journal.read`)."""
        Coordinator.replay(state["coordinator"], events["coordinator"])
        Control.replay(state["control"], events["control"])
        state["ledger"] = events["ledger"]

    def _results(self, groups: tuple[int, list[int]] | None = None) -> resume.Results:
        """Admitted results of the batches not yet trained, or of `groups` (batch, its groups)."""
        if groups is None:
            return {b: batch.results for b, batch in self.coord.batches.items()}
        b, gs = groups
        return {b: {g: self.coord.batches[b].results[g] for g in gs}} if gs else {}

    def _compact(self) -> None:
        """A new journal from a snapshot: the changes so far are in it."""
        self.coord.changes(), self.control.changes()
        self.journal.compact(self._state(), self._results())

    def _journal(self, admitted: tuple[int, list[int]] | None) -> None:
        """Every change, before the request that made it is answered."""
        self.ledger.flush()
        self.journal.append(
            {"coordinator": self.coord.changes(), "control": self.control.changes(), "ledger": self.ledger.state()},
            self._results(admitted),
        )

    def app(self, metrics_port: int | None = None, host: str = "127.0.0.1") -> web.Application:
        app = make_app(
            self.learner.store.path,
            self.token,
            max_body=messages.max_body(self.spec.lease_tokens),
            signer=Signer(self.token) if self.token else None,  # the trainer vouches for its versions
            written_here=True,  # the learner's store tells the server of each new version
        )
        app[SERVED].update(self.ledger.sent)  # counted on from a previous process's
        self.ledger.sent = app[SERVED]
        app.add_routes([*self.control.routes(), web.get("/v1/status", self.ledger.h_status)])
        add_health(app, lambda: self.coord.published >= 0)  # serving version 0 and taking work
        add_metrics(app, self.ledger.metrics, None if metrics_port is None else (host, metrics_port))
        return app

    async def train_loop(self) -> None:
        """From the version the learner holds (0, or where a previous process stopped) to the last."""
        control, learner, ledger = self.control, self.learner, self.ledger
        ledger.t_loop = time.perf_counter()
        ledger.flush()
        for b in range(learner.version, self.spec.steps):
            t0 = time.perf_counter()
            while (batch := self.coord.take(b)) is None:
                self.coord.expire()
                await control.until_changed(0.2)  # a result admitted, or time to expire leases
            control.changed()
            wait = time.perf_counter() - t0
            m = await asyncio.to_thread(learner.train, batch)
            generate_s = control.gen.pop(b, 0.0) / max(1, len(control.workers))
            partial = {
                "version": b + 1,
                "step": b,
                **m,
                "generate_s": generate_s,
                "wait_s": wait,
                "rollout_s": batch.done - (batch.opened or batch.done),
            }
            await asyncio.to_thread(learner.checkpoint, partial)
            self._compact()  # batch b's results are in the checkpoint now
            extract_s = await asyncio.to_thread(learner.publish)
            self.coord.publish(
                b + 1, learner.store.versions[b + 1].state_hash, learner.published(b + 1)["payload_bytes"]
            )
            ledger.record(partial, extract_s, time.perf_counter() - t0)
            control.changed()
        # every worker should still commit and verify the final version
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(
            self.coord.commits.get(w, (-1,))[0] < self.spec.steps for w in control.workers
        ):
            await control.until_changed(deadline - time.monotonic())
        ledger.flush(final=True)
        learner.save(self.state_dir / "final")
        learner.stop()
        ledger.summary()
        ledger.finished = True
        control.changed()


async def serve(
    spec: JobSpec, state_dir: Path, host: str, port: int, token: str, metrics_port: int | None = None
) -> None:
    run = Trainer(spec, state_dir, token)
    runner = web.AppRunner(run.app(metrics_port, host))
    await runner.setup()
    await listen(runner, host, port)
    print(f"trainer: serving on {host}:{port}", flush=True)
    try:
        await run.train_loop()
        await asyncio.sleep(2.0)  # let workers see `finished` and the runner read the summary
    finally:
        await runner.cleanup()
