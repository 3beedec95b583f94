"""What the trainer records of the job: a metrics row per version (metrics.jsonl, written once
every worker has staged that version), eval rows (eval.jsonl), and the totals that outlive a
trainer process (its time, what its origin sent, restarts, the cost). What it reports of them are
pure functions of its `snapshot()` (reports.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from sparrowrl.rollout.coordinator import Coordinator, View
from sparrowrl.trainer import cost, resume, retention
from sparrowrl.trainer.learner import Learner
from sparrowrl.trainer.reports import Snapshot


class Ledger:
    def __init__(self, state_dir: Path, learner: Learner, rates: cost.Rates | None = None):
        self.path, self.learner = state_dir / "metrics.jsonl", learner
        self.rows = self._written()  # version → metrics row
        self.written = max(self.rows, default=0)  # rows 1..written are in metrics.jsonl
        self.starts = learner.restarts  # trainer processes before this one, on this state dir
        self.resumes = 0  # of those starts, the planned ones (`restore`): the others are restarts
        self.restarts = self.starts
        self.planned = False  # this start is a planned resume
        self.seconds_before = 0.0  # the training loop's time in those processes
        self.t_loop: float | None = None  # when this process's training loop started
        self.sent_before = {"delta": 0, "base": 0}  # what earlier processes' origins sent
        self.redone = 0  # steps trained again after a restart, from their checkpoint (resume.py)
        self.finished = False
        assert learner.store is not None  # the trainer's learner: rank 0, which holds the store
        self.held = retention.Held.of(learner.store)  # as of the last prune (which runs in a thread)
        self.cost = None if rates is None else cost.Meter(rates)  # over every trainer process
        self._recorded = False  # a row recorded since `state` last gave the rows
        self.eval_path = state_dir / "eval.jsonl"
        self.evals = (
            self._kept(self.eval_path) if self.eval_path.exists() else []
        )  # written as each round is scored: a restart keeps them

    def _written(self) -> dict[int, dict]:
        return {r["version"]: r for r in self._kept(self.path)}

    @staticmethod
    def _kept(path: Path) -> list[dict]:
        """The rows a previous process wrote to a JSONL file, kept; a line a kill cut short is
        dropped from the file too, so that the rows appended after it are read again."""
        rows = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                rows.append(json.loads(line))
            except ValueError:
                break
        with resume.atomic_path(path) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return rows

    def record_eval(self, row: dict) -> None:
        """An eval round's row, written at once (eval.jsonl)."""
        self.evals.append(row)
        with open(self.eval_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    # ---- across a restart ----
    def state(self, sent: dict[str, int], whole: bool = True) -> dict:
        """`sent`: what this process's origin has sent. Not `whole`: the rows only when one was
        recorded since the last call (a journal line at every request would repeat them while
        they wait to be written; a line updates the snapshot's keys, see `journal.replay`)."""
        state = {
            "seconds": self.seconds(),
            "sent": self._total(sent),
            "redone": self.redone,
            "dollars": 0.0 if self.cost is None else self.cost.dollars,
            "resumes": self.resumes,
            "finished": self.finished,
            "steps": self.learner.spec.steps,
        }
        if whole or self._recorded:
            state["rows"] = {v: r for v, r in self.rows.items() if v > self.written}
            self._recorded = False
        return state

    def restore(self, state: dict, planned: bool = False) -> None:
        """`planned`: this start was asked for (`sparrowrl run --resume`)."""
        self.seconds_before, self.sent_before = state["seconds"], state["sent"]
        self.rows.update({int(v): r for v, r in state["rows"].items() if int(v) > self.written})
        self.redone = state["redone"]
        # this start is planned when asked for, when the process that journaled last had finished
        # its steps, or when the steps are raised (a cluster's job edited); a trainer that died is
        # started again with the journal as it left it: a restart
        steps = self.learner.spec.steps
        self.planned = planned or state["finished"] or state["steps"] < steps
        self.resumes = state["resumes"] + self.planned
        self.restarts = max(0, self.starts - self.resumes)  # `starts` lost to a kill counts from 1
        if self.cost is not None:
            self.cost.dollars, self.cost.at = state["dollars"], self.seconds_before

    def start_loop(self) -> None:
        """This process's training loop starts: its time counts from now."""
        self.t_loop = time.perf_counter()

    def trained_again(self, partial: dict, step_s: float) -> None:
        """A step trained again after a restart: its version is out already, its row too unless
        the kill came before the row was journaled (the newest, never pruned)."""
        self.redone += 1
        if partial["version"] not in self.rows:
            self.record(partial, None, step_s)

    def pruned(self, held: retention.Held) -> None:
        """What the store holds after a prune."""
        self.held = held

    def finish(self) -> None:
        self.finished = True

    def seconds(self) -> float:
        """The training loop's time, over every trainer process of this state dir."""
        return self.seconds_before + (time.perf_counter() - self.t_loop if self.t_loop else 0.0)

    def meter(self, live_regions: Callable[[], list[str | None]]) -> None:
        """The cost since the last call, at the rate of the workers live now (one region each:
        asked for only when the job has prices, since it runs at every request)."""
        if self.cost is not None:
            self.cost.to(self.seconds(), live_regions())

    # ---- metrics.jsonl ----
    def record(self, partial: dict, extract_s: float | None, step_s: float | None) -> None:
        """A published version's row: the step's metrics, and what the store says it shipped."""
        p = self.learner.published(partial["version"])
        self._recorded = True
        self.rows[partial["version"]] = {
            **partial,
            "extract_s": extract_s,
            "payload_bytes": p["payload_bytes"],
            "dense_bytes": p["dense_bytes"],
            "changed_fraction": p["changed_fraction"],
            "step_s": step_s,
        }

    def flush(self, coord: Coordinator, final: bool = False) -> None:
        """Write rows in order once every worker has staged their version (or at the end)."""
        if self.written + 1 not in self.rows:  # called on every request: mostly nothing to write
            return
        with open(self.path, "a") as f:
            while self.written + 1 in self.rows:
                v = self.written + 1
                if not final and not coord.fleet.staged(v):
                    break
                row = self.rows[v]
                row["transfer_s"] = coord.fleet.transfer_s(v)
                f.write(json.dumps(row) + "\n")
                self.written = v

    def _total(self, sent: dict[str, int]) -> dict[str, int]:
        """This process's origin's counts, and earlier processes'."""
        return {k: self.sent_before.get(k, 0) + n for k, n in sent.items()}

    def snapshot(self, job: View, steps: int, sent: dict[str, int]) -> Snapshot:
        return Snapshot(
            job=job,
            steps=steps,
            rows=[self.rows[v] for v in sorted(self.rows)],
            seconds=self.seconds(),
            sent=self._total(sent),
            restarts=self.restarts,
            redone=self.redone,
            finished=self.finished,
            store=self.held,
            dollars=None if self.cost is None else self.cost.dollars,
            resumes=self.resumes,
            evals=tuple(self.evals),
        )
