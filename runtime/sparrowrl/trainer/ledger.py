"""What the trainer records of the job, and reports: a metrics row per version
(metrics.jsonl, written once every worker has staged that version), the job's status
(JobStatus, at /v1/status), Prometheus metrics (/metrics) and the summary (summary.json)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from aiohttp import web

from sparrowrl.spec.job import JobSpec
from sparrowrl.spec.status import JobStatus, WorkerStatus
from sparrowrl.trainer import resume
from sparrowrl.trainer.control import Control
from sparrowrl.trainer.learner import Learner
from sparrowrl.transport.metrics import family

PHASES = ("generate", "train", "extract", "transfer", "wait")


class Ledger:
    def __init__(self, spec: JobSpec, state_dir: Path, learner: Learner, control: Control):
        self.spec, self.path, self.learner, self.control = spec, state_dir / "metrics.jsonl", learner, control
        self.coord = control.coord
        self.rows = self._written()  # version → metrics row
        self.written = max(self.rows, default=0)  # rows 1..written are in metrics.jsonl
        self.restarts = learner.restarts  # trainer processes before this one, on this state dir
        self.seconds_before = 0.0  # the training loop's time in those processes
        self.t_loop: float | None = None  # when this process's training loop started
        self.sent = {"delta": 0, "base": 0}  # what crossed from the origin: to relays, and to workers without one
        self.finished = False

    def _written(self) -> dict[int, dict]:
        """Rows already written (by a previous process): kept; a line cut short is dropped."""
        rows = []
        for line in self.path.read_text().splitlines() if self.path.exists() else []:
            try:
                rows.append(json.loads(line))
            except ValueError:
                break
        with resume.atomic_path(self.path) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return {r["version"]: r for r in rows}

    # ---- across a restart ----
    def state(self) -> dict:
        return {
            "seconds": self.seconds(),
            "sent": dict(self.sent),
            "rows": {v: r for v, r in self.rows.items() if v > self.written},
        }

    def restore(self, state: dict) -> None:
        self.seconds_before, self.sent = state["seconds"], state["sent"]
        self.rows.update({int(v): r for v, r in state["rows"].items() if int(v) > self.written})
        version, partial = self.learner.version, self.learner.row
        if version > self.written and version not in self.rows and partial is not None:
            # killed after its checkpoint, before its row was journaled: complete it from the store
            self.record(partial, self.learner.extract_s, None)

    def seconds(self) -> float:
        """The training loop's time, over every trainer process of this state dir."""
        return self.seconds_before + (time.perf_counter() - self.t_loop if self.t_loop else 0.0)

    # ---- metrics.jsonl ----
    def record(self, partial: dict, extract_s: float | None, step_s: float | None) -> None:
        """A published version's row: the step's metrics, and what the store says it shipped."""
        p = self.learner.published(partial["version"])
        self.rows[partial["version"]] = {
            **partial,
            "extract_s": extract_s,
            "payload_bytes": p["payload_bytes"],
            "dense_bytes": p["dense_bytes"],
            "changed_fraction": p["changed_fraction"],
            "step_s": step_s,
        }

    def flush(self, final: bool = False) -> None:
        """Write rows in order once every worker has staged their version (or at the end)."""
        if self.written + 1 not in self.rows:  # called on every request: mostly nothing to write
            return
        with open(self.path, "a") as f:
            while self.written + 1 in self.rows:
                v = self.written + 1
                if not final and not self.control.staged(v):
                    break
                row = self.rows[v]
                row["transfer_s"] = max(self.control.fetch.get(v, {}).values(), default=None)
                f.write(json.dumps(row) + "\n")
                self.written = v

    # ---- /v1/status, /metrics, summary.json ----
    async def h_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status().model_dump())

    def status(self) -> JobStatus:
        rows = [self.rows[v] for v in sorted(self.rows)]
        c, now, newest, control = self.coord.counts, time.monotonic(), self.coord.published, self.control
        held, live = {}, set(control.workers)
        for lease in self.coord.leases.values():
            held[lease.worker] = held.get(lease.worker, 0) + 1
        workers = []
        for w in sorted(control.seen):
            version, h = self.coord.commits.get(w, (None, None))
            verified = None if version is None else "ok" if self.coord.hashes.get(version) == h else "mismatch"
            workers.append(
                WorkerStatus(
                    name=w,
                    region=control.regions.get(w),
                    committed_version=version,
                    staleness=None if version is None else max(0, newest - version),
                    last_verification=verified,
                    seconds_since_seen=now - control.seen[w],
                    leases_held=held.get(w, 0),
                    stale=w not in live,
                    refused_answers=control.refused.get(w, 0),
                )
            )
        running = self.seconds()
        return JobStatus(
            phase="Succeeded" if self.finished else "Running" if control.started() else "Pending",
            step=len(rows),
            steps=self.spec.steps,
            version=newest,
            reward_last=rows[-1]["reward_mean"] if rows else None,
            reward_mean_10=sum(r["reward_mean"] for r in rows[-10:]) / len(rows[-10:]) if rows else None,
            tokens_per_second=sum(r["tokens"] for r in rows) / running if rows and running else None,
            last_payload_bytes=rows[-1]["payload_bytes"] if rows else None,
            last_changed_fraction=rows[-1]["changed_fraction"] if rows else None,
            leases_active=len(self.coord.leases),
            leases_expired=c.leases_expired,
            prompt_groups_admitted=c.admitted,
            prompt_groups_requeued=c.requeued,
            prompt_groups_lost=self.coord.lost,
            prompt_groups_discarded_late=c.discarded_late,
            commits_verified=c.verified,
            commits_mismatched=c.mismatched,
            origin_sent_delta_bytes=self.sent["delta"],
            origin_sent_base_bytes=self.sent["base"],
            trainer_restarts=self.restarts,
            workers=workers,
            stale_workers=[w.name for w in workers if w.stale],
        )

    def metrics(self) -> list:
        """/metrics: the status's counts, and the last step's phases."""
        s, c = self.status(), self.coord.counts
        last = self.rows[max(self.rows)] if self.rows else {}
        return [
            family("counter", "versions_published", "Policy versions published", s.version),
            family("counter", "steps", "Optimizer steps taken", s.step),
            family("gauge", "leases_active", "Leases out now", s.leases_active),
            family("counter", "leases_expired", "Leases whose deadline passed before their results", s.leases_expired),
            family(
                "counter",
                "prompt_groups",
                "Prompt groups by what became of them",
                by=(
                    "state",
                    {
                        "admitted": c.admitted,
                        "refused": c.refused,
                        "requeued": c.requeued,
                        "discarded_late": c.discarded_late,
                        "lost": s.prompt_groups_lost,
                    },
                ),
            ),
            family(
                "counter",
                "commit_verifications",
                "Worker commits, by whether their state hash was the trainer's",
                by=("result", {"ok": c.verified, "mismatch": c.mismatched}),
            ),
            family(
                "counter",
                "sent_bytes",
                "Bytes the origin sent, by kind",
                by=("kind", {"delta": s.origin_sent_delta_bytes, "base": s.origin_sent_base_bytes}),
            ),
            family(
                "counter", "trainer_restarts", "Trainer processes before this one on its state dir", s.trainer_restarts
            ),
            family(
                "gauge",
                "step_seconds",
                "The last step's time, by phase",
                by=("phase", {p: last[f"{p}_s"] for p in PHASES if last.get(f"{p}_s") is not None}),
            ),
            family("gauge", "changed_fraction", "Share of elements the last step changed", s.last_changed_fraction),
            family("gauge", "payload_bytes", "Bytes the last step shipped", s.last_payload_bytes),
            family(
                "gauge",
                "worker_staleness",
                "Versions a worker's committed weights lag the newest",
                by=("worker", {w.name: w.staleness for w in s.workers if w.staleness is not None}),
            ),
        ]

    def summary(self) -> dict:
        rows = [json.loads(x) for x in self.path.read_text().splitlines()]
        tenth, seconds = max(1, len(rows) // 10), self.seconds()
        c = self.coord.counts
        s = {
            "steps": len(rows),
            "reward_first": sum(r["reward_mean"] for r in rows[:tenth]) / tenth,
            "reward_last": sum(r["reward_mean"] for r in rows[-tenth:]) / tenth,
            "weights_verified": c.verified,
            "weights_mismatch": c.mismatched,
            "payload_bytes_total": sum(r["payload_bytes"] for r in rows),
            "dense_bytes_total": sum(r["dense_bytes"] for r in rows),
            "origin_sent_delta_bytes": self.sent["delta"],
            "origin_sent_base_bytes": self.sent["base"],
            "prompt_groups_admitted": c.admitted,
            "prompt_groups_lost": self.coord.lost,
            "prompt_groups_discarded_late": c.discarded_late,
            "prompt_groups_requeued": c.requeued,
            "leases_expired": c.leases_expired,
            "trainer_restarts": self.restarts,
            "tokens_per_second": sum(r["tokens"] for r in rows) / seconds,
            "seconds": seconds,
            "mode": self.spec.sync.mode,
            "final_version": self.coord.published,
            "final_state_hash": self.coord.hashes[self.coord.published],
        }
        (self.path.parent / "summary.json").write_text(json.dumps(s, indent=1))
        return s
