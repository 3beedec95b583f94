"""metav1.Condition lists, kept as Kubernetes controllers keep them: replaced by type, the
transition time kept while the status holds, terminal ones undone only by `reopen`."""

from __future__ import annotations

from sparrowrl_operator.model import Condition

TERMINAL = ("Succeeded", "Failed")


def find(conditions: list[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def is_true(conditions: list[Condition], type_: str) -> bool:
    c = find(conditions, type_)
    return c is not None and c.status == "True"


def set_condition(
    conditions: list[Condition],
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    now: str,
    generation: int | None = None,
) -> list[Condition]:
    """`conditions` with `type_` set; a terminal condition that is True stays as it is."""
    old = find(conditions, type_)
    if old is not None and old.type in TERMINAL and old.status == "True":
        return conditions
    value = "Unknown" if status is None else str(bool(status))
    since = old.last_transition_time if old is not None and old.status == value else now
    new = Condition(
        type=type_,
        status=value,
        reason=reason,
        message=message[:32768],
        last_transition_time=since,
        observed_generation=generation,
    )
    return [new if c.type == type_ else c for c in conditions] if old is not None else [*conditions, new]


def reopen(
    conditions: list[Condition], type_: str, reason: str, message: str, now: str, generation: int | None = None
) -> list[Condition]:
    """`conditions` with the terminal `type_` set False: the one way back, for a succeeded job
    whose steps were raised."""
    return set_condition([c for c in conditions if c.type != type_], type_, False, reason, message, now, generation)
