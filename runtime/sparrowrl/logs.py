"""How a process's log lines leave it: one handler on the `sparrowrl` logger that writes each record
to stdout, as its message alone (text: the lines a person reads, and greps, in the words they always
had) or as one JSON object (json: for a cluster's log pipeline, Loki, Fluent Bit, Cloud Logging).
Every module logs to `logging.getLogger(__name__)`; the role commands call `setup` with their
--log-format and --log-level, the vLLM plugin calls `adopt` in vLLM's processes. Imports nothing of
sparrowrl's, so that every layer may use it."""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import datetime, timezone
from typing import Literal, cast, get_args

Format = Literal["text", "json"]
Level = Literal["debug", "info", "warning", "error"]
FORMATS, LEVELS = get_args(Format), get_args(Level)
FORMAT_ENV = "SPARROWRL_LOG_FORMAT"
LEVEL_ENV = "SPARROWRL_LOG_LEVEL"
ROOT = "sparrowrl"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, one line: time (ISO 8601, UTC), level, logger, message, and the
    exception's traceback when there is one; the keys log pipelines look for."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class Stdout(logging.StreamHandler):
    """sys.stdout as it is when a record comes, not as it was at `setup`: a stream swapped since
    (a test's capture, a redirect) gets the line, and a closed one is never written to. Flushed
    after every record, as the lines were printed."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)  # StreamHandler's would set the stream, which is this property

    @property
    def stream(self):
        return sys.stdout


def setup(fmt: Format = "text", level: Level = "info") -> None:
    """Write the records of the `sparrowrl` loggers at `level` and above to stdout in `fmt`. Called
    again, it replaces its handler: a line is never written twice. The records stop at the
    `sparrowrl` logger: a root logger that the host process configured (vLLM's, an application's)
    would write them a second time. The environment then says the same, so that the processes
    this one starts (vLLM's engine, a trainer's ranks) `adopt` it."""
    if fmt not in FORMATS or level not in LEVELS:
        raise ValueError(f"log format {fmt!r}, level {level!r}: one of {FORMATS}, one of {LEVELS}")
    logger = logging.getLogger(ROOT)
    for h in [h for h in logger.handlers if isinstance(h, Stdout)]:
        logger.removeHandler(h)
    handler = Stdout()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
    os.environ[FORMAT_ENV], os.environ[LEVEL_ENV] = fmt, level


def adopt() -> None:
    """In a process another started (vLLM's, through the plugin; a trainer's ranks): `setup` as
    SPARROWRL_LOG_FORMAT and SPARROWRL_LOG_LEVEL say, unless this process set up already (a
    worker's in-process vLLM engine loads the plugin too). Never raises: vLLM calls the plugin
    unguarded, and a value it cannot read (`JSON`, `trace`) must not stop a server, which logs
    text at info then."""
    if not any(isinstance(h, Stdout) for h in logging.getLogger(ROOT).handlers):
        fmt = (os.environ.get(FORMAT_ENV) or "").lower()
        level = (os.environ.get(LEVEL_ENV) or "").lower()
        setup(
            cast(Format, fmt) if fmt in FORMATS else "text",
            cast(Level, level) if level in LEVELS else "info",
        )
