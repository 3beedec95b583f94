"""The trainer's journal (STATE/journal.jsonl): what a restarted trainer replays, and the one
place that reads every older format of it.

Append-only JSON lines. The first is a snapshot of the state (and the admitted results of the
batches not yet trained); each next one holds one request's changes, as events that `replay`
applies to the state, and the results it admitted. A line is written (to the OS) before the
request that caused it is answered, and is a few entries long whatever the number of workers;
`compact` starts a new file from a snapshot after every checkpoint.

Formats (the snapshot line's "format"; none before 2):
- 1: the coordinator's worker facts under "control" (with "gen" for "worker_seconds"), counts
  with "duplicated" for "discarded_late", no "refills"; a ledger without "redone", "finished",
  "steps", "resumes" or "dollars".
- 2: as `Coordinator.state` and `Ledger.state` write them now.
A newer format than this trainer knows is refused, not guessed at.
"""

from __future__ import annotations

import json
from pathlib import Path

from sparrowrl.rollout.coordinator import Coordinator
from sparrowrl.store.checkpoint_io import atomic_path
from sparrowrl.trainer.resume import ResumeError

FORMAT = 2
Results = dict[int, dict[int, dict]]  # batch → prompt group → admitted result


class Journal:
    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "a")

    def append(self, events: dict, results: Results | None = None) -> None:
        self._f.write(json.dumps({"events": events, "results": results or {}}) + "\n")
        self._f.flush()

    def compact(self, state: dict, results: Results) -> None:
        """Start again from a snapshot, with only `results` (those of batches not yet trained)."""
        with atomic_path(self.path) as tmp:
            tmp.write_text(json.dumps({"format": FORMAT, "snapshot": state, "results": results}) + "\n")
        self._f.close()
        self._f = open(self.path, "a")

    def close(self) -> None:
        self._f.close()


def read(path: Path, steps: int) -> tuple[dict | None, Results]:
    """The state after the last line, in this format, and every admitted result; a last line cut
    short by a crash is ignored. `steps`: the job's now (a format-1 ledger did not say)."""
    if not path.exists():
        return None, {}
    state: dict | None = None
    results: Results = {}
    fmt = FORMAT
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break  # the write the crash interrupted: its request was never answered
            raise ResumeError(f"{path}: line {i + 1} is damaged (not JSON)") from None
        try:
            if "snapshot" in entry:
                fmt = entry.get("format", 1)
                if fmt not in (1, FORMAT):
                    raise ResumeError(
                        f"{path}: journal format {fmt!r}, this trainer reads 1..{FORMAT}: a newer sparrowrl wrote it"
                    )
                state = entry["snapshot"] if fmt == FORMAT else _snapshot_from_1(entry["snapshot"], steps)
            else:
                if state is None:  # caught below: a damaged journal
                    raise TypeError("events before any snapshot")
                replay(state, entry["events"] if fmt == FORMAT else _events_from_1(entry["events"]))
            for b, groups in entry["results"].items():
                results.setdefault(int(b), {}).update({int(g): r for g, r in groups.items()})
        except (ValueError, KeyError, AttributeError, TypeError) as e:
            raise ResumeError(f"{path}: line {i + 1} is damaged ({type(e).__name__}: {e})") from None
    return state, results


def replay(state: dict, events: dict) -> None:
    """Apply one line's events to a snapshot."""
    Coordinator.replay(state["coordinator"], events["coordinator"])
    state["ledger"].update(events["ledger"])  # a line's ledger has its rows only when they changed


def _snapshot_from_1(state: dict, steps: int) -> dict:
    coord = state["coordinator"]
    if (old := state.pop("control", None)) is not None:
        old["worker_seconds"] = old.pop("gen")
        coord.update(old)
    coord["counts"] = _counts_from_1(coord["counts"])
    coord.setdefault("refills", {})
    ledger = state["ledger"]
    for key, value in (("redone", 0), ("finished", False), ("steps", steps), ("resumes", 0), ("dollars", 0.0)):
        ledger.setdefault(key, value)
    return state


def _events_from_1(events: dict) -> dict:
    coord = [["counts", _counts_from_1(e[1])] if e[0] == "counts" else e for e in events["coordinator"]]
    coord += [["worker_seconds", *e[1:]] if e[0] == "gen" else e for e in events.get("control", [])]
    return {"coordinator": coord, "ledger": events["ledger"]}


def _counts_from_1(counts: dict) -> dict:
    return {("discarded_late" if k == "duplicated" else k): n for k, n in counts.items()}
