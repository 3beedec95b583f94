"""The `sparrowrl` command: its commands in the order `--help` lists them, and what a base install
says when a command needs the runtime. Failures print one line naming the check that failed and exit 1."""

from __future__ import annotations

import sys

import typer

from sparrowrl.cli import delta, job, roles, serve, store
from sparrowrl.cli.common import err

RUNTIME = {
    "torch",
    "numpy",
    "safetensors",
    "zstandard",
    "aiohttp",
    "numba",
    "transformers",
    "tokenizers",
    "matplotlib",
    "prometheus_client",
    "cryptography",
}  # the [runtime] extra

app = typer.Typer(no_args_is_help=True, add_completion=False, help="SparrowRL: sparse delta weight sync for RL.")
app.add_typer(delta.app, name="delta")
app.add_typer(store.app, name="store")
for name, command in (
    ("serve", serve.serve),
    ("relay", roles.relay),
    ("fetch", serve.fetch),
    ("check", job.check),
    ("run", job.run),
    ("credentials", job.credentials),
    ("status", job.status),
    ("trainer", roles.trainer),
    ("worker", roles.worker),
):
    app.command(name)(command)


def main() -> None:
    try:
        app()
    except ModuleNotFoundError as e:  # a base install: the CLI, the job spec and `status` only
        if e.name not in RUNTIME:
            raise
        err.print(
            f"error: this command needs the runtime ({e.name} is not installed): pip install 'sparrowrl[runtime]'",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(1)
