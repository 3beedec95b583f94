"""What every command shares, so that a failure reads the same whichever command it comes from: one
line naming the check that failed, and exit 1 (or the code the command gives)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console

from sparrowrl.logs import FORMAT_ENV, LEVEL_ENV, Format, Level

out = Console()
err = Console(stderr=True)

Out = Annotated[Path, typer.Option("-o", "--output", help="Where to write; written only if everything verifies.")]
LogFormat = Annotated[
    Format,
    typer.Option(
        envvar=FORMAT_ENV, help="Log lines as their text alone, or one JSON object each (for a log pipeline)."
    ),
]
LogLevel = Annotated[
    Level, typer.Option(envvar=LEVEL_ENV, case_sensitive=False, help="The least level of log lines written.")
]


def fail(e: Exception, code: int = 1) -> NoReturn:
    err.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def in_range(flag: str, value: float | None, low: float, high: float) -> None:
    """Flags that size loops, connections or files: finite and bounded, else one line naming the flag."""
    if value is not None and not (math.isfinite(value) and low <= value <= high):
        fail(ValueError(f"{flag} {value} is out of range {low:g}..{high:g}"))
