"""`sparrowrl run JOB.yaml`: the whole job on one machine. The trainer (with its store, server and
coordinator), one relay per region and the workers run as separate local processes on loopback,
exactly as they would across machines; this process only starts them, shows progress, and
collects the results."""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from sparrowrl.auth import tokens
from sparrowrl.auth.signing import KEY_ENV
from sparrowrl.cli import report
from sparrowrl.logs import FORMAT_ENV, LEVEL_ENV, Format, Level
from sparrowrl.spec import layout
from sparrowrl.spec.job import JobSpec, SparrowRLJob
from sparrowrl.spec.layout import Process
from sparrowrl.spec.statedir import PLANNED_RESUME, state_mismatch

EXE = [sys.executable, "-P", "-m", "sparrowrl.cli"]  # -P: the working folder does not shadow modules
OUTPUTS = (
    "job.yaml",
    "token",
    "trainer.ready",
    "metrics.jsonl",
    "eval.jsonl",
    "summary.json",
    "processes.json",
    "reward.png",
    "step_time.png",
    "payload.png",
    "objective.png",
    "eval.png",
    "store",
    "model",
    "hub",
    "final",
    "logs",
    "relays",
    "job.json",
    "trainer",
    "nodes",
    "journal.jsonl",
    "starts",
    PLANNED_RESUME,
    ".trainer.lock",
    ".processes.json.tmp",
)
MARK = ".sparrowrl-run"  # names a folder as a run's: the only kind a run replaces


class RunError(Exception):
    pass


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the runner dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG). Children run in sessions of their own, so nothing else would reach them."""
    if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM) != 0:  # 1: PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """Children with their logs under RUN/logs; all of them stop when the run ends, however."""

    def __init__(self, run_dir: Path, env: dict, append: bool = False):
        self.logs, self.env, self.append = run_dir / "logs", env, append  # append: a resumed run's logs follow on
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.args: dict[str, list[str]] = {}
        self.restarts: dict[str, int] = defaultdict(int)
        self.own_env: dict[str, dict] = {}

    def start(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        """`env`: what this process gets besides the run's environment (its credentials)."""
        log = open(self.logs / f"{name}.log", "a" if self.append or name in self.procs else "w")  # a restart's too
        env = self.own_env[name] = self.own_env.get(name, {}) if env is None else env
        p = subprocess.Popen(
            EXE + args,
            env={**self.env, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        self.procs[name], self.args[name] = p, args
        return p

    def restart(self, gang: list[str], limit: int) -> dict[str, int] | None:
        """Start the gang (the trainer's nodes, or one process) again, all of it, if one of them
        exited with an error and restarts are left (counted for the gang); the exit codes if so."""
        codes = {n: self.procs[n].poll() for n in gang}
        failed = {n: c for n, c in codes.items() if c not in (None, 0)}
        if not failed or self.restarts[gang[0]] >= limit:
            return None
        self.restarts[gang[0]] += 1
        for n in gang:
            self._end([self.procs[n]])
        for n in gang:
            self.start(n, self.args[n])
        return failed

    def failed(self) -> str | None:
        """Why the run cannot go on, if it cannot: the trainer died (and `restart` gave up), or
        every worker did.
        A lost relay or worker is survivable: workers fall back to the origin, and a lost
        worker's leases expire and go to the others."""
        dead = {name: p.returncode for name, p in self.procs.items() if p.poll() not in (None, 0)}
        workers = [n for n in self.procs if n.startswith("worker-")]
        nodes = [n for n in self.procs if n == "trainer" or n.startswith("trainer-node-")]
        culprit = next((n for n in nodes if n in dead), None)
        culprit = culprit or (workers[0] if workers and set(workers) <= set(dead) else None)
        if culprit is None:
            return None
        tail = (self.logs / f"{culprit}.log").read_text().strip().splitlines()[-15:]
        what = "the trainer" if culprit in nodes else "every worker"
        return f"{what} exited ({culprit}: {dead[culprit]}):\n  " + "\n  ".join(tail)

    def lost(self) -> list[str]:
        return sorted(n for n, p in self.procs.items() if p.poll() not in (None, 0))

    def stop(self) -> None:
        self._end(list(self.procs.values()))

    @staticmethod
    def _end(procs: list[subprocess.Popen]) -> None:
        """SIGTERM to each one's session, SIGKILL 5 s later to those still running."""
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + 5
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _exit(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def _get(url: str, token: str, ctx: ssl.SSLContext | None = None) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
        return json.loads(r.read())


# what a run that goes on from a previous run's state writes anew; the trainer's state and results stay
RESTARTED = ("summary.json", "processes.json", "trainer.ready", ".processes.json.tmp", "job.yaml")


def check_run_dir(run_dir: Path, overwrite: bool, resume: JobSpec | None = None) -> None:
    """Refuse a run dir that a run may not write to, before anything is written: one that holds
    what this tool did not write (never deleted, whatever the flags), a previous run's results
    without `overwrite` or `resume`, or, to `resume` job spec, no state or another job's."""
    if resume is not None:
        if overwrite:
            raise RunError("--resume goes on from a run's state; --overwrite replaces it: give one")
        try:
            saved = json.loads((run_dir / "job.json").read_text()) if (run_dir / MARK).is_file() else None
        except (OSError, ValueError):
            saved = None
        if saved is None:
            raise RunError(f"--run-dir {run_dir}: no previous run's trainer state to resume from")
        if (why := state_mismatch(saved, resume.model_dump(mode="json"))) is not None:
            raise RunError(f"--run-dir {run_dir} holds the state of another job ({why}); it goes on only as that job")
        return
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise RunError(f"--run-dir {run_dir}: not a folder")
    names = {p.name for p in run_dir.iterdir()}
    # a run's folder: marked, or (made before the mark) holding a run's names and nothing else
    previous = MARK in names or ("job.yaml" in names and names <= set(OUTPUTS))
    if previous and not overwrite:
        raise RunError(f"--run-dir {run_dir} holds a previous run's results; --overwrite replaces them")
    if names and not previous:
        raise RunError(
            f"--run-dir {run_dir}: not empty, and not a previous run's folder: "
            f"a run writes only to a new or empty folder, or replaces a previous run's"
        )


def claim_run_dir(run_dir: Path, job: SparrowRLJob, overwrite: bool, resume: bool = False) -> None:
    """Check the folder, mark it as a run's, and remove a previous run's results: only the
    names a run writes (with `resume`, only what the run writes anew: the trainer goes on from
    its state, which refuses another job's)."""
    check_run_dir(run_dir, overwrite, job.spec if resume else None)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / MARK).write_text(json.dumps({"job": job.metadata.name}) + "\n")
        for stale in RESTARTED if resume else OUTPUTS:
            path = run_dir / stale
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)
    except OSError as e:
        raise RunError(f"--run-dir {run_dir}: {e.strerror} ({e.filename})") from None


def _owners(path: Path, data: bytes) -> None:
    """`data` written to `path`, readable by its owner alone (also where a previous run left it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class Tls:
    """`sparrowrl run --tls`: the run's own CA (RUN/tls/ca.crt) and a serving certificate for
    127.0.0.1 it signs, which the trainer and the relays serve and every client trusts."""

    def __init__(self, run_dir: Path, name: str):
        from sparrowrl.auth import pki

        self.folder = run_dir / "tls"
        self.folder.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.folder, 0o700)
        ca = pki.authority(f"sparrowrl run {name}")
        served = pki.serving(ca, ["127.0.0.1", "localhost"], days=3650)  # the CA's key is not kept: none renews it
        self.ca, self.cert, self.key = self.folder / "ca.crt", self.folder / "serving.crt", self.folder / "serving.key"
        for path, data in ((self.ca, ca.cert), (self.cert, served.cert), (self.key, served.key)):
            _owners(path, data)
        self.context = ssl.create_default_context(cafile=str(self.ca))

    def serves(self) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key)]


class LocalNodes:
    """The trainer's nodes on this machine, for a job with trainer.nodes above 1: node 0 is the
    `trainer` process, on the run dir; node K is `trainer-node-K`, on RUN/nodes/K (each node's
    state dir stands for its pod's volume). They meet on a loopback port, and all their ranks share
    this machine's cores."""

    def __init__(self, spec: JobSpec, run_dir: Path):
        t = spec.trainer
        self.names = ["trainer", *(f"trainer-node-{k}" for k in range(1, t.nodes))]
        self.port, self.run_dir = free_port(), run_dir
        self.threads = max(1, (os.cpu_count() or 1) // (t.nodes * t.ranks))

    def args(self, node: int) -> list[str]:
        """What node `node`'s command line adds (node 0's too)."""
        meet = ["--rendezvous", f"127.0.0.1:{self.port}", "--threads", str(self.threads)]
        if node == 0:
            return meet
        return ["--state-dir", str(self.run_dir / "nodes" / str(node)), "--node", str(node), *meet]


def argv(
    role: Process, spec: JobSpec, run_dir: Path, port: int, tls: Tls | None = None, gang: LocalNodes | None = None
) -> list[str]:
    """The role's command line, as a user would type it in a shell of its own (README)."""
    rate = ["--rate-mbit", str(role.rate_mbit)] if role.rate_mbit else []
    trusts = ["--ca-cert", str(tls.ca)] if tls else []
    if role.kind == "trainer":
        serves = tls.serves() if tls else []
        nodes = gang.args(0) if gang else []
        job = str(run_dir / "job.yaml")
        return ["trainer", job, "--state-dir", str(run_dir), "--port", str(port), *serves, *nodes]
    assert role.trainer is not None and role.region is not None  # a relay's and a worker's (layout.processes)
    if role.kind == "relay":
        return [
            "relay",
            "--upstream",
            role.trainer,
            "--port",
            str(port),
            "--cache",
            str(run_dir / "relays" / role.region),
            "--streams",
            str(spec.sync.streams),
            *rate,
            *trusts,
            *(tls.serves() if tls else []),
        ]
    return [
        "worker",
        "--trainer",
        role.trainer,
        *(["--relay", role.relay] if role.relay else []),
        "--name",
        role.name,
        "--region",
        role.region,
        "--port",
        str(port),
        *rate,
        *trusts,
    ]


def _ready(url: str, procs: Processes, ctx: ssl.SSLContext | None = None) -> None:
    """Until `url`/readyz answers 200, as a kubelet's readiness probe would ask."""
    while True:
        if err := procs.failed():
            raise RunError(err)
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=5, context=ctx) as r:
                if r.status == 200:
                    return
        except OSError:  # not listening yet, or 503
            pass
        time.sleep(0.2)


def run(
    job: SparrowRLJob,
    run_dir: Path,
    console: Console,
    overwrite: bool = False,
    resume: bool = False,
    log_format: Format = "text",
    log_level: Level = "info",
    tls: bool = False,
) -> dict:
    """Run `job` in `run_dir` (see `check_run_dir`): the roles of `layout.processes`, each a process
    on its own loopback port, started with the same commands a user types by hand. With `resume`,
    the trainer goes on from the run dir's state (with more steps, say). Each writes its log lines
    to RUN/logs/NAME.log in `log_format` (their environment's SPARROWRL_LOG_FORMAT), from `log_level` up.
    With `tls`, every hop is HTTPS, under the run's own CA (`Tls`)."""
    spec = job.spec
    kept = _token(run_dir) if resume else None
    claim_run_dir(run_dir, job, overwrite, resume)
    if resume:
        (run_dir / PLANNED_RESUME).write_text("sparrowrl run --resume\n")
    (run_dir / "job.yaml").write_text(yaml.safe_dump(job.model_dump(by_alias=True, exclude_none=True), sort_keys=False))
    token = os.environ.get("SPARROWRL_TOKEN") or kept or secrets.token_hex(16)
    _owners(run_dir / "token", (token + "\n").encode())  # for `sparrowrl status RUN_DIR`
    env = {k: x for k, x in os.environ.items() if k not in ("SPARROWRL_TOKEN", KEY_ENV)}
    procs = Processes(
        run_dir, {**env, "PYTHONUNBUFFERED": "1", FORMAT_ENV: log_format, LEVEL_ENV: log_level}, append=resume
    )
    ports: dict[str, int] = defaultdict(free_port)
    secure = Tls(run_dir, job.metadata.name) if tls else None
    ctx = secure.context if secure else None

    def url(name: str, _region: str | None = None) -> str:  # one machine: the same address from everywhere
        return f"{'https' if secure else 'http'}://127.0.0.1:{ports[name]}"

    everyone = layout.processes(spec, url)
    origin = url("trainer")
    gang = LocalNodes(spec, run_dir) if spec.trainer.nodes > 1 else None
    pids: dict = {"trainer": None, "relays": {}, "workers": {}, "urls": {r.name: url(r.name) for r in everyone}}
    signal.signal(signal.SIGTERM, _exit)  # a terminated run stops its children too (the finally below)
    signal.signal(signal.SIGHUP, _exit)
    try:
        for role in everyone:
            who = role.region if role.kind == "relay" else role.name
            assert who is not None  # a relay's region (layout.processes)
            p = procs.start(
                role.name,
                argv(role, spec, run_dir, ports[role.name], secure, gang),  # each its own credentials
                tokens.environment(token, role.kind, who),
            )
            if role.kind == "trainer":
                pids["trainer"] = p.pid
                if gang:  # its other nodes, with no token: they serve nothing
                    pids["trainer_nodes"] = {
                        name: procs.start(name, ["trainer", str(run_dir / "job.yaml"), *gang.args(k)], {}).pid
                        for k, name in enumerate(gang.names[1:], 1)
                    }
                with console.status("starting the trainer (model, store, server) ..."):
                    _ready(origin, procs, ctx)
            else:
                pids[role.kind + "s"][role.name] = p.pid
        _write_pids(run_dir, pids)
        _follow(origin, token, spec, procs, run_dir, console, pids, gang.names if gang else ["trainer"], ctx)
        procs.procs["trainer"].wait(timeout=60)
    finally:
        procs.stop()
    summary = json.loads((run_dir / "summary.json").read_text())
    report.plots(run_dir, summary["mode"])
    return summary


def _token(run_dir: Path) -> str | None:
    """The secret a previous run in `run_dir` had (its versions' signing key derives from it)."""
    try:
        return (run_dir / "token").read_text().strip() or None
    except OSError:
        return None


def _write_pids(run_dir: Path, pids: dict) -> None:
    """processes.json, replaced whole: a reader never sees half of it."""
    tmp = run_dir / ".processes.json.tmp"
    tmp.write_text(json.dumps(pids, indent=1))
    os.replace(tmp, run_dir / "processes.json")


def _follow(
    origin: str,
    token: str,
    spec: JobSpec,
    procs: Processes,
    run_dir: Path,
    console: Console,
    pids: dict,
    trainer: list[str],
    ctx: ssl.SSLContext | None = None,
) -> None:
    """Progress until the summary is written. A trainer that exits with an error is started again,
    `runPolicy.backoffLimit` times at most (as the operator does in a cluster); it resumes from
    its state dir."""
    steps, limit = spec.steps, spec.run_policy.backoff_limit
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} steps"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
    ) as progress:
        task = progress.add_task("training", total=steps, info="waiting for workers")
        while not (run_dir / "summary.json").exists():
            if (codes := procs.restart(trainer, limit)) is not None:
                n = procs.restarts["trainer"]
                exits = ", ".join(map(str, codes.values()))
                said = (
                    f"the trainer exited ({exits}); started again"
                    if len(trainer) == 1
                    else f"{', '.join(codes)} of the trainer's {len(trainer)} nodes exited ({exits}); all of them "
                    f"started again"
                )
                progress.console.print(f"{said} ({n}/{limit}), it resumes from {run_dir}")
                pids["trainer"] = procs.procs["trainer"].pid
                for name in trainer[1:]:
                    pids["trainer_nodes"][name] = procs.procs[name].pid
                _write_pids(run_dir, pids)
            if err := procs.failed():
                raise RunError(err)
            try:
                s = _get(f"{origin}/v1/status", token, ctx)
            except OSError:
                s = None
            if s:
                reward = "-" if s["reward_mean_10"] is None else f"{s['reward_mean_10']:.3f}"
                lost = procs.lost()
                live = len(s["workers"]) - len(s["stale_workers"])
                progress.update(
                    task,
                    completed=s["step"],
                    info=f"reward {reward} · {live} workers · commits verified {s['commits_verified']}, "
                    f"mismatched {s['commits_mismatched']}" + (f" · exited: {', '.join(lost)}" if lost else ""),
                )
            time.sleep(0.5)
        progress.update(task, completed=steps)
