"""A stand-in for the node side of an emulated cluster (tests/support/kube.py): the kubelet, kube-proxy,
cluster DNS and a cloud load balancer controller, so that the Pods an operator creates really run,
as local processes from this venv, and reach each other through Services.

This is the outer edge of the operator's tests, the part that cannot run here: no container
runtime, no nodes, no network namespaces. Everything runs on this machine's loopback addresses,
on the cluster's own event loop, and on a compressed clock (probes every 0.25 s, a grace of at
most 2 s, restarts after 0.25-2 s).

What it does:
- Pods: init containers one after the other, then the single container: each one's command +
  args, with $(VAR) expansion, run under
  `unshare --mount` with env (value; secretKeyRef, configMapKeyRef, fieldRef), envFrom, a fresh
  per-pod working directory, volumes bind-mounted below it (configMap, secret, emptyDir,
  persistentVolumeClaim: one directory per claim that outlives its pods; a missing claim, Secret
  or ConfigMap leaves the pod Pending; a Secret's or ConfigMap's volume is written as a kubelet's
  AtomicWriter does and kept up to date while the pod runs, except through a subPath), an IP of
  its own (127.A.1-253.x), readiness (httpGet over HTTP or HTTPS, the certificate unchecked;
  tcpSocket), the status a kubelet writes (initContainerStatuses too), restartPolicy, graceful
  deletion, a log file per pod (every container's), a failed container's termination message
  from the end of its log (terminationMessagePolicy: FallbackToLogsOnError; no message file).
- Services: a proxy per port on the cluster IP to the ready pods its selector matches; node
  ports on the node (127.A.254.1); a load balancer address (127.A.255.x, written to the status);
  a headless Service's name resolves to the IPs of the pods it selects (not yet ready ones too
  with publishNotReadyAddresses), as cluster DNS answers;
  DNS names in an /etc/hosts bind-mounted into each pod (NAME.NS.svc.cluster.local, NAME.NS.svc,
  NAME.NS, and NAME within NS). Load balancers and node ports are behind the cluster's edge
  Gate, so Cluster.unreachable() cuts them too.
- A Node object; PersistentVolumeClaims bound when a pod first uses them.

What it does not: images (so `command` is required: there is no entrypoint to fall back to), more
than one container, sidecar containers, exec probes, liveness and startup probes,
resources, scheduling (every pod lands on the one node), network isolation (any process can
connect to any loopback address; pods in one cluster reach another only by IP because only
their own cluster's names resolve), UDP, Services without a selector,
hostnames, service-account tokens, the Service environment variables, controllers (Deployments,
Jobs, StatefulSets: only bare pods run).
Volume mounts must lie under the container's workingDir, mapped to the per-pod directory (but
an emptyDir may cover /dev/shm, the pod's own shared memory, as a sharded trainer's has), and
an absolute path under workingDir in command, args or env fails the pod: with relative paths a
pod behaves the same here and in a real cluster.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Self

import aiohttp

from sparrowrl.cachedir import own
from support.kube import ApiError, Cluster, Gate, now, path

PROBE_EVERY = 0.25
REFRESH = 1.0  # seconds between a running pod's syncs of its Secret and ConfigMap volumes (a kubelet: ~60)
GRACE_CAP = 2.0
BIN = str(Path(sys.executable).parent)
# numba's compiled kernels, kept where this machine's own runs keep them and shared by every pod:
# a compile per pod (seconds each) would cost CI minutes and show nothing. The one departure from
# a pod's env (tests/test_images.py runs the pods' own).
NUMBA_CACHE = own("numba")


class Unsupported(Exception):
    """The pod asks for what this stand-in cannot do: it fails, and so does the test."""


class Waiting(Exception):
    """The pod cannot start yet (a Secret, ConfigMap or claim is missing): it stays Pending."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, $$ is a $, the rest stays."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text
    )


def _write_atomically(directory: Path, files: dict[str, tuple[str, int]]) -> None:
    """As a kubelet writes a Secret's or ConfigMap's volume (its AtomicWriter): the files in a new
    timestamped folder, `..data` switched to it by one rename, each name a link through `..data`,
    so that a reader sees the old files or the new ones, never half of each."""
    directory.mkdir(parents=True, exist_ok=True)
    version = directory / f"..{time.time_ns()}"
    for rel, (text, mode) in files.items():
        file = version / rel
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text)
        file.chmod(mode)
    link = directory / "..data_tmp"
    link.unlink(missing_ok=True)
    link.symlink_to(version.name)
    old = os.readlink(directory / "..data") if (directory / "..data").is_symlink() else None
    os.replace(link, directory / "..data")
    for top in {PurePosixPath(rel).parts[0] for rel in files}:
        if not (directory / top).is_symlink():
            (directory / top).symlink_to(f"..data/{top}")
    if old:
        shutil.rmtree(directory / old, ignore_errors=True)


def _decoded(data: Mapping[str, str] | None) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in (data or {}).items()}


@dataclass
class Run:
    """One pod as this kubelet runs it."""

    pod: dict[str, Any]
    ip: str
    root: Path
    log: Path
    started: str = field(default_factory=now)
    process: asyncio.subprocess.Process | None = None
    running_since: str | None = None
    ready: bool = False
    restarts: int = 0
    restart_at: float | None = None
    waiting: dict[str, str] | None = None
    last: dict[str, Any] | None = None  # the previous container's end, after a restart
    inits: list[dict[str, Any]] = field(default_factory=list)  # the ends of the init containers run to completion
    log_from: int = 0  # where the running container's output starts in the log
    final: dict[str, Any] | None = None  # the end of the pod: Succeeded or Failed
    failure: str | None = None  # why the stand-in failed it
    stopping: bool = False
    written: dict[str, Any] | None = None
    projected: dict[str, dict[str, tuple[str, int]]] = field(default_factory=dict)  # Secret/ConfigMap volumes' files
    refreshed: float = 0.0

    @property
    def key(self) -> tuple[str, str]:
        return self.pod["metadata"]["namespace"], self.pod["metadata"]["name"]

    @property
    def main(self) -> dict[str, Any]:
        return self.pod["spec"]["containers"][0]

    @property
    def initializing(self) -> bool:
        return len(self.inits) < len(self.pod["spec"].get("initContainers") or [])

    @property
    def container(self) -> dict[str, Any]:
        """The container that runs now, or runs next: an init container until they are done."""
        return self.pod["spec"]["initContainers"][len(self.inits)] if self.initializing else self.main

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None


class Kubelet:
    """The node of one cluster, run on that cluster's event loop (start and stop from the test's
    thread). `logs` holds a log per pod: `log()` reads one (and serves pods/NAME/log), `dump()`
    all of them for a failing test; `kill`, `pause`, `resume` and `signal` do to a pod's
    processes what a node can; `errors` collects what it could not do (kubelets() fails on it)."""

    def __init__(self, cluster: Cluster, root: Path) -> None:
        self.cluster = cluster
        self.root = root / cluster.name
        self.logs = self.root / "logs"
        self.node = f"{cluster.name}-node"
        self.errors: list[str] = []
        self._runs: dict[str, Run] = {}  # by pod uid
        self._services: dict[tuple[str, str], dict[str, Any]] = {}
        self._headless: dict[tuple[str, str], dict[str, Any]] = {}  # their names resolve to the pods' own IPs
        self._listening: dict[tuple[str, int], Gate] = {}
        self._load_balancers: dict[str, str] = {}  # Service uid -> address
        self._round_robin = itertools.count()
        self._pod_ips = (f"127.{cluster.subnet}.{1 + n // 254}.{1 + n % 254}" for n in range(253 * 254))
        self._lb_ips = (f"127.{cluster.subnet}.255.{n}" for n in range(1, 255))
        self._etc_hosts = Path("/etc/hosts").read_text()
        self._hosts_text = ""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wake = asyncio.Event()
        self._inside = Gate()
        self._session: aiohttp.ClientSession | None = None
        self._processes: set[asyncio.subprocess.Process] = set()
        self._commands: dict[str, list[str]] = {}  # by log file name: what ran, for dump()

    # --- the test's side (any thread) ---------------------------------------------------------

    def start(self) -> Self:
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.root / "hosts").mkdir(exist_ok=True)
        self.cluster.call(self._start())
        self.cluster.emulator.pod_logs = self.log
        return self

    def stop(self) -> None:
        self.cluster.emulator.pod_logs = None
        self.cluster.call(self._stop())

    def log(self, namespace: str, name: str) -> str | None:
        """The log of the newest pod of that name, or None."""
        logs = sorted(self.logs.glob(f"{namespace}.{name}.*.log"), key=lambda p: p.stat().st_mtime)
        return logs[-1].read_text(errors="replace") if logs else None

    def dump(self) -> str:
        """Every pod's log and every error, for a failed test's output."""
        parts = [
            "\n".join([f"--- {p.name} ---", *self._commands.get(p.name, []), "---", p.read_text(errors="replace")])
            for p in sorted(self.logs.glob("*.log"))
        ]
        parts += [f"--- kubelet error ---\n{e}" for e in self.errors]
        return f"=== kubelet of {self.cluster.name} ===\n" + "\n".join(parts)

    def signal(self, namespace: str, name: str, sig: int) -> None:
        """Signal a pod's processes: SIGKILL as a node loses a container, SIGSTOP/SIGCONT to
        hang one and let it go on. AssertionError if no such pod runs."""
        self.cluster.call(self._signal(namespace, name, sig))

    def kill(self, namespace: str, name: str) -> None:
        self.signal(namespace, name, signal.SIGKILL)

    def pause(self, namespace: str, name: str) -> None:
        self.signal(namespace, name, signal.SIGSTOP)

    def resume(self, namespace: str, name: str) -> None:
        self.signal(namespace, name, signal.SIGCONT)

    # --- the cluster's loop --------------------------------------------------------------------

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(self.cluster.internal_url, timeout=aiohttp.ClientTimeout(total=30))
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.node, "labels": {"kubernetes.io/hostname": self.node}},
        }
        await self._api("POST", "/api/v1/nodes", node)
        await self._api(
            "PATCH",
            f"/api/v1/nodes/{self.node}/status",
            {
                "status": {
                    "addresses": [
                        {"type": "InternalIP", "address": self.cluster.node_ip},
                        {"type": "Hostname", "address": self.node},
                    ],
                    "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                }
            },
        )
        for watched in ("/api/v1/pods", "/api/v1/services"):
            self._spawn(self._watch(watched))
        self._spawn(self._loop())

    async def _stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for process in self._processes:
            _signal_group(process, signal.SIGKILL)
            await process.wait()
        await self._inside.close()
        for (host, port), gate in self._listening.items():
            if gate is self.cluster.edge:
                await gate.unlisten(host, port)
        if self._session is not None:
            await self._session.close()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """A background task whose failure is an error of this kubelet (so of the test)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)

        def done(task: asyncio.Task[Any]) -> None:
            self._tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                self.errors.append("".join(traceback.format_exception(task.exception())))

        task.add_done_callback(done)

    async def _api(self, method: str, url_path: str, body: Any = None) -> Any:
        """A request to the emulator; None if the object is not there (any more)."""
        assert self._session is not None
        kind = "application/merge-patch+json" if method == "PATCH" else "application/json"
        data = None if body is None else json.dumps(body)
        async with self._session.request(method, url_path, data=data, headers={"Content-Type": kind}) as resp:
            if resp.status == 404:
                return None
            if resp.status >= 400:
                raise ApiError(resp.status, await resp.text())
            return await resp.json(content_type=None)

    async def _watch(self, url_path: str) -> None:
        """Wake the loop on every change of pods or Services."""
        while True:
            try:
                assert self._session is not None
                async with self._session.get(
                    url_path, params={"watch": "true"}, timeout=aiohttp.ClientTimeout()
                ) as resp:
                    async for _ in resp.content:
                        self._wake.set()
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self._sync()
            except Exception:
                self.errors.append(traceback.format_exc())
            due = [r.restart_at - time.monotonic() for r in self._runs.values() if r.restart_at is not None]
            # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancel that meets a
            # wake, and this loop would outlive stop().
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, min([1.0, *due]))):
                    await self._wake.wait()

    async def _sync(self) -> None:
        pods = (await self._api("GET", "/api/v1/pods"))["items"]
        await self._sync_services((await self._api("GET", "/api/v1/services"))["items"])
        seen = set()
        for pod in pods:
            seen.add(pod["metadata"]["uid"])
            await self._sync_pod(pod)
        for uid in set(self._runs) - seen:
            run = self._runs.pop(uid)
            if not run.stopping:
                self._spawn(self._terminate(run, delete=False))

    # --- pods ------------------------------------------------------------------------------------

    async def _sync_pod(self, pod: dict[str, Any]) -> None:
        meta, uid = pod["metadata"], pod["metadata"]["uid"]
        run = self._runs.get(uid)
        if meta.get("deletionTimestamp"):
            if run is None:
                await self._api("DELETE", path("v1/pods", meta["namespace"], meta["name"]) + "?gracePeriodSeconds=0")
            elif not run.stopping:
                run.pod = pod
                self._spawn(self._terminate(run, delete=True))
            return
        if run is None:
            if pod.get("status", {}).get("phase") not in (None, "Pending") or pod["spec"].get("nodeName") not in (
                None,
                self.node,
            ):
                return
            run = self._runs[uid] = Run(
                pod,
                next(self._pod_ips),
                self.root / "pods" / uid,
                self.logs / f"{meta['namespace']}.{meta['name']}.{uid[:8]}.log",
            )
            await self._api(
                "PATCH", path("v1/pods", meta["namespace"], meta["name"]), {"spec": {"nodeName": self.node}}
            )
            self._spawn(self._probe(run))
        run.pod = pod
        if run.final is None and run.process is not None and run.process.returncode is not None:
            self._exited(run)
        if run.final is None and run.process is None and (run.restart_at or 0) <= time.monotonic():
            await self._run(run)
        if run.process is not None and run.process.returncode is None:
            await self._refresh(run)
        await self._report(run)

    async def _run(self, run: Run) -> None:
        """Start the container, or say why not (Waiting: later; Unsupported: never)."""
        try:
            env, mounts = await self._prepare(run)
        except Waiting as e:
            run.waiting = {"reason": e.reason, "message": e.message}
            return
        except Unsupported as e:
            self._fail(run, str(e))
            return
        workdir = run.root / "work"
        script = ["set -e", f"mount --bind {shlex.quote(str(self._hosts(run.key[0])))} /etc/hosts"]
        for source, target, read_only in mounts:
            script.append(f"mount --bind {shlex.quote(str(source))} {shlex.quote(str(target))}")
            if read_only:
                script.append(f"mount -o remount,bind,ro {shlex.quote(str(target))}")
        if (run.container.get("securityContext") or {}).get("readOnlyRootFilesystem"):
            # the host's root read-only for this container: only its mounts (bound above) stay writable
            script.append("mount -o remount,bind,ro /")
        script.append('exec "$@"')
        argv = [expand(a, env) for a in run.container.get("command", []) + run.container.get("args", [])]
        environ = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "HOSTNAME": run.key[1], **env}
        self._commands.setdefault(run.log.name, []).append(f"{now()} start {run.restarts}: {shlex.join(argv)}")
        with run.log.open("ab") as log:
            run.log_from = log.tell()
            try:
                run.process = await asyncio.create_subprocess_exec(
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    "\n".join(script),
                    "sh",
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    env=environ,
                    cwd=workdir,
                    start_new_session=True,
                )
            except OSError as e:
                self._fail(run, f"cannot start: {e}")
                return
        run.running_since, run.waiting, run.restart_at = now(), None, None
        run.ready = not run.initializing and "readinessProbe" not in run.container
        self._processes.add(run.process)
        self._spawn(self._reap(run.process))

    def _fail(self, run: Run, why: str) -> None:
        """The pod fails for good, and so will the test (Kubelet.errors)."""
        run.failure = f"{run.key[0]}/{run.key[1]}: {why}"
        self.errors.append(f"the kubelet stand-in cannot run pod {run.failure}")
        run.final = {"exitCode": 128, "reason": "Unsupported", "message": why, "finishedAt": now()}

    async def _reap(self, process: asyncio.subprocess.Process) -> None:
        await process.wait()
        self._processes.discard(process)
        self._wake.set()

    def _exited(self, run: Run) -> None:
        """The container ended: restart it (restartPolicy), or the pod is over."""
        assert run.process is not None and run.process.returncode is not None
        code = run.process.returncode
        end = {
            "exitCode": 128 - code if code < 0 else code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": run.running_since,
            "finishedAt": now(),
        }
        if code < 0:
            end["signal"] = -code
        if code and run.container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            with run.log.open("rb") as log:  # a kubelet's: the last 80 lines, at most 2048 bytes
                log.seek(run.log_from)
                end["message"] = b"\n".join(log.read().splitlines()[-80:])[-2048:].decode(errors="replace")
        run.process, run.ready = None, False
        policy = run.pod["spec"].get("restartPolicy", "Always")
        if run.initializing and code == 0:
            run.inits.append(end)  # the next one starts at the next sync
        elif policy == "Always" or (policy == "OnFailure" and code != 0):
            run.last, run.restarts = end, run.restarts + 1
            run.restart_at = time.monotonic() + min(0.25 * 2 ** (run.restarts - 1), 2.0)
            run.waiting = {
                "reason": "CrashLoopBackOff",
                "message": f"back-off restarting after exit code {end['exitCode']}",
            }
        else:
            run.final = end  # an init container's: the pod never initialized

    async def _terminate(self, run: Run, delete: bool) -> None:
        """SIGTERM, a short grace, SIGKILL; then remove the pod object if it is being deleted."""
        run.stopping = True
        if run.alive:
            assert run.process is not None
            spec_grace = run.pod["metadata"].get(
                "deletionGracePeriodSeconds", run.pod["spec"].get("terminationGracePeriodSeconds", 30)
            )
            _signal_group(run.process, signal.SIGCONT)
            _signal_group(run.process, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(float(spec_grace), GRACE_CAP)):
                    await run.process.wait()
        if run.process is not None:
            _signal_group(run.process, signal.SIGKILL)
            await run.process.wait()
        if delete:
            namespace, name = run.key
            await self._api("DELETE", path("v1/pods", namespace, name) + "?gracePeriodSeconds=0")

    async def _signal(self, namespace: str, name: str, sig: int) -> None:
        runs = [r for r in self._runs.values() if r.key == (namespace, name) and r.alive]
        assert runs, f"no process runs for pod {namespace}/{name}"
        assert runs[0].process is not None
        _signal_group(runs[0].process, sig)

    async def _probe(self, run: Run) -> None:
        """The readiness probe, for as long as the pod is here."""
        probe = run.main.get("readinessProbe")
        if not probe:
            return
        failures = 0
        while not run.stopping and run.final is None:
            await asyncio.sleep(PROBE_EVERY)
            if not run.alive or run.initializing:
                continue
            ok = await self._probe_once(run, probe)
            failures = 0 if ok else failures + 1
            ready = ok or (run.ready and failures < probe.get("failureThreshold", 3))
            if ready != run.ready and run.alive:
                run.ready = ready
                self._wake.set()

    async def _probe_once(self, run: Run, probe: dict[str, Any]) -> bool:
        timeout = probe.get("timeoutSeconds", 1)
        try:
            if get := probe.get("httpGet"):
                scheme = get.get("scheme", "HTTP").lower()  # HTTPS: the certificate is not checked, as a kubelet's
                url = f"{scheme}://{get.get('host', run.ip)}:{self._port(run, get['port'])}{get.get('path', '/')}"
                async with (
                    aiohttp.ClientSession() as session,
                    session.get(url, timeout=aiohttp.ClientTimeout(total=timeout), ssl=False) as resp,
                ):
                    return 200 <= resp.status < 400
            if tcp := probe.get("tcpSocket"):
                async with asyncio.timeout(timeout):
                    _, writer = await asyncio.open_connection(run.ip, self._port(run, tcp["port"]))
                writer.close()
                return True
        except (OSError, TimeoutError, aiohttp.ClientError):
            return False
        raise Unsupported(f"readinessProbe {sorted(probe)}: only httpGet and tcpSocket probes are emulated")

    def _port(self, run: Run, port: int | str) -> int | None:
        """A port by number or by the container's name for it."""
        if isinstance(port, int) or port.isdigit():
            return int(port)
        return next((p["containerPort"] for p in run.container.get("ports", []) if p.get("name") == port), None)

    async def _report(self, run: Run) -> None:
        """Write the pod's status as a kubelet would, when it changed."""
        c, inits = run.main, run.pod["spec"].get("initContainers") or []
        initialized = not run.initializing
        if run.final is not None and initialized:
            state: dict[str, Any] = {"terminated": run.final}
        elif run.alive and initialized:
            state = {"running": {"startedAt": run.running_since}}
        elif initialized:
            state = {"waiting": run.waiting or {"reason": "ContainerCreating"}}
        else:
            state = {"waiting": {"reason": "PodInitializing"}}
        ready = run.ready and run.alive and initialized
        status = {
            "phase": ("Succeeded" if run.final["exitCode"] == 0 else "Failed")
            if run.final is not None
            else "Running"
            if initialized and (run.alive or run.restarts)
            else "Pending",
            "hostIP": self.cluster.node_ip,
            "podIP": run.ip,
            "podIPs": [{"ip": run.ip}],
            "startTime": run.started,
            "conditions": [
                {"type": t, "status": str(v)}
                for t, v in (
                    ("PodScheduled", True),
                    ("Initialized", initialized),
                    ("ContainersReady", ready),
                    ("Ready", ready),
                )
            ],
            "containerStatuses": [
                {
                    "name": c["name"],
                    "image": c.get("image", ""),
                    "ready": ready,
                    "started": run.alive,
                    "restartCount": run.restarts,
                    "state": state,
                    "lastState": {"terminated": run.last} if run.last and initialized else {},
                }
            ],
        }
        if inits:
            status["initContainerStatuses"] = [
                {
                    "name": ic["name"],
                    "image": ic.get("image", ""),
                    "ready": i < len(run.inits) and run.inits[i]["exitCode"] == 0,
                    "restartCount": run.restarts if i == len(run.inits) else 0,
                    "state": {"terminated": run.inits[i]}
                    if i < len(run.inits)
                    else {"terminated": run.final}
                    if i == len(run.inits) and run.final is not None
                    else {"running": {"startedAt": run.running_since}}
                    if i == len(run.inits) and run.alive
                    else {"waiting": run.waiting or {"reason": "PodInitializing"}},
                }
                for i, ic in enumerate(inits)
            ]
        if run.failure:
            status |= {"reason": "Unsupported", "message": run.failure}
        if status != run.written:
            namespace, name = run.key
            await self._api("PATCH", path("v1/pods", namespace, name, "status"), {"status": status})
            run.written = status

    async def _prepare(self, run: Run) -> tuple[dict[str, str], list[tuple[Path, Path, bool]]]:
        """The container's env and its mounts (source, target, read-only)."""
        pod, c = run.pod, run.container
        spec, namespace = pod["spec"], run.key[0]
        if len(spec["containers"]) != 1:
            raise Unsupported("one container (and init containers)")
        if not c.get("command"):
            raise Unsupported("no command: images are not run, so there is no entrypoint")
        env: dict[str, str] = {}
        for source in c.get("envFrom", []):
            data = await self._data(namespace, source)
            env |= {source.get("prefix", "") + k: v for k, v in data.items()}
        for var in c.get("env", []):
            if "valueFrom" not in var:
                env[var["name"]] = expand(var.get("value", ""), env)
            elif (value := await self._value_from(run, var["valueFrom"])) is not None:
                env[var["name"]] = value
        workdir = PurePosixPath(c.get("workingDir", "/nonexistent"))
        for text in c.get("command", []) + c.get("args", []) + list(env.values()):
            if re.search(rf"(^|[\s=:,]){re.escape(str(workdir))}(/|$|[\s:,])", expand(text, env)):
                raise Unsupported(
                    f"{text!r} names a path under workingDir {workdir}: it is not mapped here, pass it relative"
                )
        (run.root / "work").mkdir(parents=True, exist_ok=True)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        mounts = []
        for mount in c.get("volumeMounts", []):
            if mount["mountPath"] == "/dev/shm" and "emptyDir" in volumes[mount["name"]]:  # the pod's own, shared
                source, _ = await self._volume(run, volumes[mount["name"]])  # memory: a fresh folder over it
                mounts.append((source, Path("/dev/shm"), False))
                continue
            if mount["mountPath"] == "/tmp" and "emptyDir" in volumes[mount["name"]]:
                # the pod's own temporary folder: TMPDIR, and the env's paths in /tmp mapped into
                # it, since a folder over the host's /tmp would hide the run's own folders (a
                # read-only root leaves it writable, as a mount)
                source, _ = await self._volume(run, volumes[mount["name"]])
                for k, v in env.items():  # the pod's own values
                    if v == "/tmp" or v.startswith("/tmp/"):
                        env[k] = str(source) + v.removeprefix("/tmp")
                env.setdefault("TMPDIR", str(source))
                mounts.append((source, source, False))
                continue
            try:
                relative = PurePosixPath(mount["mountPath"]).relative_to(workdir)
            except ValueError:
                raise Unsupported(
                    f"volume mount {mount['mountPath']} is not under workingDir {c.get('workingDir')}"
                ) from None
            volume = volumes[mount["name"]]
            source, read_only = await self._volume(run, volume)
            source = source / mount.get("subPath", "")
            target = run.root / "work" / relative
            if source.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.touch()
            mounts.append((source, target, read_only or mount.get("readOnly", False)))
        if NUMBA_CACHE is not None:  # in place of the pod's own, and writable under a read-only root
            env["NUMBA_CACHE_DIR"] = str(NUMBA_CACHE)
            mounts.append((NUMBA_CACHE, NUMBA_CACHE, False))
        return env, mounts

    async def _value_from(self, run: Run, source: dict[str, Any]) -> str | None:
        namespace = run.key[0]
        if ref := source.get("secretKeyRef") or source.get("configMapKeyRef"):
            data = await self._data(namespace, {"secretRef" if "secretKeyRef" in source else "configMapRef": ref})
            if ref["key"] not in data and not ref.get("optional"):
                raise Waiting("CreateContainerConfigError", f"couldn't find key {ref['key']} in {ref['name']}")
            return data.get(ref["key"])
        if ref := source.get("fieldRef"):
            fields = {
                "metadata.name": run.key[1],
                "metadata.namespace": namespace,
                "metadata.uid": run.pod["metadata"]["uid"],
                "spec.nodeName": self.node,
                "spec.serviceAccountName": run.pod["spec"].get("serviceAccountName", "default"),
                "status.podIP": run.ip,
                "status.hostIP": self.cluster.node_ip,
            }
            if m := re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", ref["fieldPath"]):
                return run.pod["metadata"].get(m[1], {}).get(m[2], "")
            if ref["fieldPath"] in fields:
                return fields[ref["fieldPath"]]
            raise Unsupported(f"fieldRef {ref['fieldPath']}")
        raise Unsupported(f"valueFrom {sorted(source)}")

    async def _data(self, namespace: str, source: Mapping[str, Any]) -> dict[str, str]:
        """A Secret's or ConfigMap's data, decoded, from an envFrom-style {secretRef|configMapRef}."""
        secret = "secretRef" in source
        ref = source["secretRef" if secret else "configMapRef"]
        obj = await self._api("GET", path("v1/secrets" if secret else "v1/configmaps", namespace, ref["name"]))
        if obj is None:
            if ref.get("optional"):
                return {}
            raise Waiting(
                "CreateContainerConfigError", f'{"secret" if secret else "configmap"} "{ref["name"]}" not found'
            )
        return _decoded(obj.get("data")) if secret else {**obj.get("data", {}), **_decoded(obj.get("binaryData"))}

    async def _volume(self, run: Run, volume: dict[str, Any]) -> tuple[Path, bool]:
        """The directory that is the volume (made now), and whether it is read-only."""
        namespace = run.key[0]
        directory = run.root / "volumes" / volume["name"]
        if "emptyDir" in volume:
            directory.mkdir(parents=True, exist_ok=True)
            # as a kubelet makes one: anyone may write it, it is not sticky; setgid with an fsGroup
            directory.chmod(0o2777 if (run.pod["spec"].get("securityContext") or {}).get("fsGroup") else 0o777)
            return directory, False
        if claim := volume.get("persistentVolumeClaim"):
            pvc = await self._api("GET", path("v1/persistentvolumeclaims", namespace, claim["claimName"]))
            if pvc is None:
                raise Waiting("ContainerCreating", f'persistentvolumeclaim "{claim["claimName"]}" not found')
            if pvc.get("status", {}).get("phase") != "Bound":
                await self._api(
                    "PATCH",
                    path("v1/persistentvolumeclaims", namespace, claim["claimName"], "status"),
                    {
                        "status": {
                            "phase": "Bound",
                            "accessModes": pvc["spec"].get("accessModes", []),
                            "capacity": pvc["spec"].get("resources", {}).get("requests", {}),
                        }
                    },
                )
            directory = self.root / "volumes" / namespace / claim["claimName"]
            directory.mkdir(parents=True, exist_ok=True)
            return directory, claim.get("readOnly", False)
        if "secret" in volume or "configMap" in volume:
            files = await self._projected(namespace, volume)
            _write_atomically(directory, files)
            run.projected[volume["name"]] = files
            return directory, True
        raise Unsupported(f"volume {volume['name']}: only configMap, secret, emptyDir and persistentVolumeClaim")

    async def _projected(self, namespace: str, volume: dict[str, Any]) -> dict[str, tuple[str, int]]:
        """A Secret's or ConfigMap's volume's files: path → (content, mode)."""
        kind, ref_key = ("secret", "secretName") if "secret" in volume else ("configMap", "name")
        source = volume[kind]
        data = await self._data(
            namespace,
            {
                "secretRef" if kind == "secret" else "configMapRef": {
                    "name": source[ref_key],
                    "optional": source.get("optional"),
                }
            },
        )
        files = {}
        for item in source.get("items") or [{"key": k, "path": k} for k in data]:
            if item["key"] not in data:
                raise Waiting("ContainerCreating", f"{kind} {source[ref_key]} has no key {item['key']}")
            files[item["path"]] = (data[item["key"]], item.get("mode", source.get("defaultMode", 0o644)))
        return files

    async def _refresh(self, run: Run) -> None:
        """A running pod's Secret and ConfigMap volumes brought up to date, as a kubelet's sync does
        (not what a subPath mounted: that was bound to the file at the start)."""
        if time.monotonic() < run.refreshed + REFRESH:
            return
        run.refreshed = time.monotonic()
        volumes = {v["name"]: v for v in run.pod["spec"].get("volumes", [])}
        for name, files in list(run.projected.items()):
            try:
                now_files = await self._projected(run.key[0], volumes[name])
            except (Waiting, KeyError):
                continue  # gone or incomplete: a kubelet keeps what it wrote
            if now_files != files:
                _write_atomically(run.root / "volumes" / name, now_files)
                run.projected[name] = now_files

    # --- Services and DNS ------------------------------------------------------------------------

    async def _sync_services(self, services: list[dict[str, Any]]) -> None:
        wanted: dict[tuple[str, int], tuple[Gate, tuple[str, str], int]] = {}
        announce: list[tuple[tuple[str, str], list[dict]]] = []  # load balancers' addresses, once they listen
        self._services, self._headless = {}, {}
        for svc in services:
            spec, meta = svc["spec"], svc["metadata"]
            key = (meta["namespace"], meta["name"])
            if spec.get("clusterIP") == "None" and spec.get("selector"):
                self._headless[key] = svc
                continue
            if spec.get("clusterIP") in (None, ""):
                continue
            self._services[key] = svc
            if spec["type"] == "LoadBalancer":
                if meta["uid"] not in self._load_balancers:
                    self._load_balancers[meta["uid"]] = next(self._lb_ips)
                ingress = [{"ip": self._load_balancers[meta["uid"]]}]
                if svc.get("status", {}).get("loadBalancer", {}).get("ingress") != ingress:
                    announce.append((key, ingress))
            for port in spec.get("ports", []):
                if port.get("protocol", "TCP") != "TCP":
                    continue
                wanted[spec["clusterIP"], port["port"]] = (self._inside, key, port["port"])
                if port.get("nodePort"):
                    wanted[self.cluster.node_ip, port["nodePort"]] = (self.cluster.edge, key, port["port"])
                if spec["type"] == "LoadBalancer":
                    wanted[self._load_balancers[meta["uid"]], port["port"]] = (self.cluster.edge, key, port["port"])
        for address in set(self._listening) - set(wanted):
            await self._listening.pop(address).unlisten(*address)
        for address in set(wanted) - set(self._listening):
            gate, key, port = wanted[address]
            try:
                await gate.listen(*address, lambda key=key, port=port: self._endpoint(key, port))
            except OSError as e:
                self.errors.append(f"cannot listen on {address} for Service {key}: {e}")
                continue
            self._listening[address] = gate
        for key, ingress in announce:  # a client that reads the address finds it listening
            await self._api(
                "PATCH", path("v1/services", *key, "status"), {"status": {"loadBalancer": {"ingress": ingress}}}
            )
        await self._write_hosts()

    def _endpoint(self, key: tuple[str, str], port: int) -> tuple[str, int] | None:
        """Where a connection to a Service's port goes now: a ready pod it selects, in turn."""
        svc = self._services.get(key)
        if svc is None or not svc["spec"].get("selector"):
            return None
        spec_port = next((p for p in svc["spec"].get("ports", []) if p["port"] == port), None)
        selector = svc["spec"]["selector"].items()
        targets = [
            (run.ip, target)
            for run in self._runs.values()
            if run.key[0] == key[0]
            and run.ready
            and run.alive
            and not run.stopping
            and selector <= (run.pod["metadata"].get("labels") or {}).items()
            and spec_port is not None
            and (target := self._port(run, spec_port.get("targetPort", port)))
        ]
        return targets[next(self._round_robin) % len(targets)] if targets else None

    def _hosts(self, namespace: str) -> Path:
        """The /etc/hosts of pods in this namespace (written now if it is new)."""
        file = self.root / "hosts" / namespace
        if not file.exists():
            file.write_text(self._hosts_for(namespace))
        return file

    def _hosts_for(self, namespace: str) -> str:
        lines = [self._etc_hosts.rstrip("\n")]
        for (ns, name), svc in sorted(self._services.items()):
            lines.append(
                f"{svc['spec']['clusterIP']} {name}.{ns}.svc.cluster.local {name}.{ns}.svc {name}.{ns}"
                + (f" {name}" if ns == namespace else "")
            )
        for (ns, name), svc in sorted(self._headless.items()):  # the pods it selects, ready or (if published) not
            selector = svc["spec"]["selector"].items()
            for run in sorted(self._runs.values(), key=lambda r: r.ip):
                if (
                    run.key[0] == ns
                    and run.final is None
                    and not run.stopping
                    and (run.ready or svc["spec"].get("publishNotReadyAddresses"))
                    and selector <= (run.pod["metadata"].get("labels") or {}).items()
                ):
                    lines.append(
                        f"{run.ip} {name}.{ns}.svc.cluster.local {name}.{ns}.svc {name}.{ns}"
                        + (f" {name}" if ns == namespace else "")
                    )
        return "\n".join(lines) + "\n"

    async def _write_hosts(self) -> None:
        """Rewrite every namespace's hosts file in place (same inode: pods have it bind-mounted)."""
        text = self._hosts_for("")
        if text == self._hosts_text:
            return
        self._hosts_text = text
        for file in (self.root / "hosts").iterdir():
            with file.open("r+") as f:
                f.truncate(0)
                f.write(self._hosts_for(file.name))


def _signal_group(process: asyncio.subprocess.Process, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


@contextlib.contextmanager
def kubelets(*clusters: Cluster, root: Path) -> Iterator[tuple[Kubelet, ...]]:
    """Kubelets for these clusters, stopped at the end. If the test fails, every pod's log is
    printed; if a kubelet met a pod it cannot run (or failed itself), the test fails."""
    started: list[Kubelet] = []
    try:
        for cluster in clusters:
            started.append(Kubelet(cluster, root))
            started[-1].start()
        yield tuple(started)
    except BaseException:
        for kubelet in started:
            print(kubelet.dump())
        raise
    finally:
        for kubelet in reversed(started):
            kubelet.stop()
    if errors := [e for kubelet in started for e in kubelet.errors]:
        raise AssertionError("the kubelet stand-in failed:\n" + "\n".join(errors))
