"""Whether a trainer's saved state may go on under a job spec, and the marker of a planned resume."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from sparrowrl.spec.job import JobSpec

# what a trainer's state belongs to: another value is another job's state (steps may only grow)
BELONGS = ("seed", "model", "task", "grpo", "sync", "trainer.ranks", "trainer.nodes", "trainer.sharding")


def _at(spec: dict[str, Any], dotted: str) -> object:
    at: object = spec
    for key in dotted.split("."):
        at = at.get(key) if isinstance(at, dict) else None
    return at


# In a trainer's state dir: its next start is a planned resume (`sparrowrl run --resume`), which
# counts in trainer_resumes and not as a restart. The trainer takes it (removes it) as it starts.
PLANNED_RESUME = "planned-resume"


def state_mismatch(saved: object, spec: dict[str, Any]) -> str | None:
    """Why a state made for the job `saved` cannot go on under `spec` (both job specs as JSON),
    or None. More steps is the same job trained on; anything else it belongs to is not."""
    if not isinstance(saved, dict):
        return "job.json holds no job spec"
    try:  # a state written before a field was added holds no value for it: the default's
        saved = {**saved, **JobSpec.model_validate(saved).model_dump(mode="json")}
    except ValidationError:
        pass
    for field in BELONGS:
        if _at(saved, field) != _at(spec, field):
            return f"spec.{field} differs"
    if not isinstance(saved.get("steps"), int) or spec["steps"] < saved["steps"]:
        return f"spec.steps is {spec['steps']}, below the {saved.get('steps')} it was made for"
    return None
