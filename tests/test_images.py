"""The images themselves, built by `make images` and run as a cluster runs them: each role of a
job in its own container from the runtime image, with the pod spec the operator's builders make
(its command, arguments, env, working folder, user and mounts), on a read-only root; and the
operator image as the chart's Deployment runs it. Where no docker daemon answers, buildah builds
and podman runs (as root: hack/images.sh, hack/containers.conf). tests/test_image.py is the fast
recreation of the same conditions, without a container."""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from support import jobs
from support.bounded import free_port
from support.imports import IMPORT_ALL
from support.kube import clusters
from support.servers import get
from support.wait import until

from sparrowrl.auth import pki
from sparrowrl.spec.job import parse
from sparrowrl.spec.layout import processes
from sparrowrl_operator import builders, podspec
from sparrowrl_operator.constants import TOKEN_KEY

ROOT = Path(__file__).resolve().parent.parent
TAG = "e2e"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
RUNTIME = f"localhost/sparrowrl/sparrowrl-runtime:{TAG}"
OPERATOR = f"localhost/sparrowrl/sparrowrl-operator:{TAG}"
ENV = {
    **os.environ,
    "CONTAINERS_CONF": str(ROOT / "hack" / "containers.conf"),
    "CONTAINERS_STORAGE_CONF": str(ROOT / "hack" / "storage.conf"),
}


def engine() -> str | None:
    """docker where its daemon answers, else podman (what `make images` builds with): as root,
    which gives the volumes to the images' user."""
    if os.geteuid() != 0:
        return None
    try:
        if (
            shutil.which("docker")
            and subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
        ):
            return "docker"
    except subprocess.TimeoutExpired:  # a daemon that does not answer
        pass
    return "podman" if shutil.which("podman") and shutil.which("buildah") else None


ENGINE = engine()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.xdist_group("images"),  # one build, on one xdist worker
    pytest.mark.skipif(ENGINE is None, reason="needs root, and a docker daemon or buildah and podman"),
]


@pytest.fixture(scope="module")
def images() -> None:
    """Both images, built from this checkout (the layers that did not change come from the store)."""
    env = {k: v for k, v in ENV.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    p = subprocess.run(
        ["make", "images", "REGISTRY=localhost/sparrowrl", f"TAG={TAG}",
         f"CONTAINER={'docker' if ENGINE == 'docker' else 'buildah'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]


READ_ONLY = ["--read-only", "--tmpfs", "/tmp"]  # a read-only root and a /tmp of its own: an emptyDir


def container(name: str, options: list[str], image: str, args: list[str]) -> list[str]:
    """`ENGINE run` of a container on the host's network, removed when it ends; one of the name
    that a killed test left is removed first."""
    stop(name)
    return [ENGINE, "run", "--rm", "--name", name, "--network", "host", *options, image, *args]


def stop(name: str) -> None:
    subprocess.run([ENGINE, "rm", "-f", name], env=ENV, capture_output=True, timeout=60)


def folder(path: Path, owner: int) -> Path:
    path.mkdir(parents=True)
    os.chown(path, owner, owner)
    return path


class Pod:
    """A pod the operator's builders make, as `ENGINE run` arguments: its user, security context,
    working folder, env (secrets and the downward API resolved) and mounts (host folders; a
    Secret's volume written as the kubelet writes it, its items as files; an emptyDir not among
    them a folder of its own). On the host's network the ports are free ones, and the Services'
    URLs loopback ones."""

    def __init__(self, manifest: dict, secrets: dict[str, dict], mounts: dict[str, Path], ports: dict[str, int]):
        self.manifest, self.secrets, self.ports = manifest, secrets, ports
        self.mounts = dict(mounts)
        for v in manifest["spec"].get("volumes", []):
            if "secret" in v:  # beside the other mounts, one folder per pod and volume
                data = secrets[v["secret"]["secretName"]]
                where = next(iter(mounts.values())).parent / "secrets" / manifest["metadata"]["name"] / v["name"]
                where.mkdir(parents=True, exist_ok=True)
                for item in v["secret"].get("items") or [{"key": k, "path": k} for k in data]:
                    (where / item["path"]).write_text(data[item["key"]])
                self.mounts[v["name"]] = where

    def argv(self, c: dict) -> list[str]:
        spec = self.manifest["spec"]
        sc, csc = spec["securityContext"], c.get("securityContext", {})
        out = ["--user", f"{sc['runAsUser']}:{sc['runAsUser']}", "--workdir", c["workingDir"]]
        out += ["--cap-drop", "ALL"] if "ALL" in csc.get("capabilities", {}).get("drop", []) else []
        out += ["--security-opt", "no-new-privileges"] if csc.get("allowPrivilegeEscalation") is False else []
        out += ["--read-only"] if csc.get("readOnlyRootFilesystem") else []
        for e in c.get("env", []):
            out += ["--env", f"{e['name']}={self.value(e)}"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for m in c.get("volumeMounts", []):
            if m["name"] not in self.mounts and "emptyDir" in volumes[m["name"]]:
                # a folder as a kubelet makes one: anyone may write it, not sticky, setgid (an fsGroup)
                where = next(iter(self.mounts.values())).parent / "emptyDirs" / self.manifest["metadata"]["name"]
                (where / m["name"]).mkdir(parents=True, exist_ok=True)
                (where / m["name"]).chmod(0o2777)
                out += ["--volume", f"{where / m['name']}:{m['mountPath']}"]
                continue
            out += ["--volume", f"{self.mounts[m['name']]}:{m['mountPath']}{':ro' if m.get('readOnly') else ''}"]
        return [*out, "--entrypoint", c["command"][0]]

    def value(self, e: dict) -> str:
        if "value" in e:
            return e["value"]
        ref = e["valueFrom"]
        if "secretKeyRef" in ref:
            return self.secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
        return {"metadata.name": self.manifest["metadata"]["name"], "status.podIP": "127.0.0.1"}[
            ref["fieldRef"]["fieldPath"]
        ]

    def args(self, c: dict) -> list[str]:
        """The container's arguments, $(POD_IP) expanded as the kubelet does, with free ports."""
        out = [a.replace("$(POD_IP)", "127.0.0.1") for a in c.get("args", [])]
        for flag, port in (("--port", self.ports["http"]), ("--metrics-port", self.ports["metrics"])):
            if flag in out:
                out[out.index(flag) + 1] = str(port)
        return out


def answer(url: str, context: ssl.SSLContext) -> int:
    """The status of a GET over HTTPS that trusts `context`'s CA (0: no answer yet)."""
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def test_the_images_labels_name_this_checkouts_commit(images):
    """OCI labels, set on the build's command line: a cached step would keep an older commit's."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    for image in (RUNTIME, OPERATOR):
        p = subprocess.run([ENGINE, "image", "inspect", image], env=ENV, capture_output=True, text=True, timeout=60)
        info = json.loads(p.stdout)[0]
        labels = info.get("Labels") or info["Config"]["Labels"]
        assert labels["org.opencontainers.image.revision"].removesuffix("-dirty") == (head or "unknown"), labels
        assert labels["org.opencontainers.image.version"] == VERSION and labels["org.opencontainers.image.title"]


@pytest.mark.timeout(1800)
def test_every_module_imports_in_the_runtime_image_as_its_user_without_a_word(images):
    """uid 65532, HOME=/, a read-only root: every module imports (CuPy's and matplotlib's caches
    go where the user may write), and nothing is said on stderr."""
    options = [*READ_ONLY, "--user", "65532:65532", "--entrypoint", "python"]
    p = subprocess.run(
        container("sparrowrl-e2e-imports", options, RUNTIME, ["-c", IMPORT_ALL]), env=ENV, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0 and not p.stderr, p.stderr[-3000:]
    assert int(p.stdout) > 70


# its data set read with `datasets`, which caches under HOME: in a pod, the pod's /tmp
INPUTS = {"name": "inputs", "mountPath": "/var/lib/sparrowrl/inputs", "readOnly": True}
JOB = jobs.job(
    "img",
    steps=3,
    task={"dataset": {"path": "inputs/sums.jsonl"}},
    grpo=jobs.GRPO,
    rollout={"groupsPerLease": 2},
    topology={"regions": [{"name": "a", "workers": 1}]},
    trainer={
        "template": {
            "spec": {
                "volumes": [{"name": "inputs", "configMap": {"name": "sums"}}],
                "containers": [{"name": "trainer", "volumeMounts": [INPUTS]}],
            }
        }
    },
)
JOB["metadata"]["namespace"] = "default"


@pytest.mark.timeout(1800)
def test_a_jobs_roles_run_in_their_containers_as_the_operator_makes_their_pods(images, tmp_path):
    """The trainer (after `sparrowrl check`, its init container), a relay and a worker, each in a
    container of the runtime image as uid 65532 on the read-only root their pods ask for, where
    only the trainer's state, the relay's cache and each one's /tmp are writable: the job takes
    its 3 steps and every commit is verified. A bad job is refused by the check with exit 3,
    before a trainer starts."""
    spec = parse(JOB).spec
    job = builders.JobRef(name="img", namespace="default", uid="0123456789")
    ports = {p.name: {"http": free_port(), "metrics": free_port()} for p in processes(spec, lambda n, r: "")}
    roles = processes(spec, lambda name, region: f"https://127.0.0.1:{ports[name]['http']}")
    secret = "s3cret-of-the-job"
    ca = pki.authority("img")  # every hop HTTPS, as the operator makes a job's pods by default
    secrets = {builders.token_name(job): {TOKEN_KEY: secret}}
    for role in roles:
        made = (
            [builders.credentials_secret(job, role, secret, "default", True, ca.cert)] if role.kind != "trainer" else []
        )
        made.append(builders.serving_secret(job, role, "default", True, pki.serving(ca, ["127.0.0.1"]), ca.cert))
        secrets |= {
            s["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in builders.stored(s)["data"].items()}
            for s in made
        }
    trusting = ssl.create_default_context(cadata=ca.cert.decode())
    config = builders.job_config(job, JOB["spec"])
    (tmp_path / "job.yaml").write_text(config["data"][builders.JOB_KEY])
    tmp_path.chmod(0o755)
    mounts = {"job": tmp_path / "job.yaml", "state": folder(tmp_path / "state", 65532)}
    mounts["cache"] = folder(tmp_path / "cache", 65532)
    mounts["inputs"] = tmp_path / "inputs"  # the ConfigMap's files
    mounts["inputs"].mkdir()
    (mounts["inputs"] / "sums.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(32))
    )
    procs, names = {}, []
    try:
        for role in roles:
            template = spec.trainer.template if role.kind == "trainer" else None
            manifest = podspec.pod(
                job, role, spec, namespace="default", attempt=0, image=RUNTIME, home=True, template=template
            )
            pod = Pod(manifest, secrets, mounts, ports[role.name])
            for c in manifest["spec"].get("initContainers", []):  # sparrowrl check
                names.append(f"sparrowrl-e2e-{c['name']}")
                argv = container(names[-1], pod.argv(c), c["image"], pod.args(c))
                p = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=300)
                assert p.returncode == 0 and "load here" in p.stdout + p.stderr, p.stdout + p.stderr
            (c,) = manifest["spec"]["containers"]
            assert "--read-only" in pod.argv(c)  # as the pod asks, not as this test adds
            names.append(f"sparrowrl-e2e-{role.name}")
            argv = container(names[-1], pod.argv(c), c["image"], pod.args(c))
            procs[role.name] = subprocess.Popen(
                argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            probe = "readyz" if role.kind != "worker" else "healthz"
            url = f"https://127.0.0.1:{ports[role.name]['http']}/{probe}"
            until(lambda: answer(url, trusting) == 200, 300, f"{url} answering", every=0.2, alive=procs)
        summary = mounts["state"] / "summary.json"
        until(summary.exists, 600, "the job's summary", every=1, alive={"trainer": procs["trainer"]})
        s = json.loads(summary.read_text())
        assert s["steps"] == 3 and s["weights_mismatch"] == 0 and s["weights_verified"] >= 4, s
    finally:
        for name in names:
            stop(name)
    # what a read-only root left writable: the state volume, the relay's cache (and each container's own /tmp)
    assert (mounts["state"] / "store").is_dir() and any(mounts["cache"].iterdir())

    bad = dict(JOB, spec=dict(JOB["spec"], grpo=dict(JOB["spec"]["grpo"], groupSize=1)))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(bad))
    manifest = podspec.pod(
        job, roles[0], spec, namespace="default", attempt=0, image=RUNTIME, home=True, template=spec.trainer.template
    )
    (c,) = manifest["spec"]["initContainers"]
    pod = Pod(manifest, secrets, mounts, ports["trainer"])
    argv = container("sparrowrl-e2e-bad-check", pod.argv(c), c["image"], pod.args(c))
    p = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 3 and "spec.grpo.groupSize" in p.stdout + p.stderr, p.stdout + p.stderr


@pytest.mark.timeout(600)
def test_the_operator_image_answers_its_probe_as_the_charts_deployment_runs_it(images, tmp_path):
    """The chart's Deployment: the image's entrypoint (the chart's command is the same, with the
    namespace flags), its env, user, dropped capabilities and read-only root (a /tmp of its own),
    logged in to an emulated cluster by a kubeconfig: kopf's liveness endpoint answers."""
    values = yaml.safe_load((ROOT / "charts" / "sparrowrl-operator" / "values.yaml").read_text())
    user, sc = values["podSecurityContext"]["runAsUser"], values["securityContext"]
    assert sc["readOnlyRootFilesystem"] and sc["capabilities"]["drop"] == ["ALL"]
    kube = tmp_path / "kube"
    kube.mkdir()
    with clusters("home") as (home,):
        (kube / "config").write_text(yaml.safe_dump(home.kubeconfig()))
        kube.chmod(0o755)
        (kube / "config").chmod(0o644)
        name = "sparrowrl-e2e-operator"
        options = [*READ_ONLY, "--user", f"{user}:{user}", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
        options += ["--volume", f"{kube}:/kube:ro", "--env", "KUBECONFIG=/kube/config"]
        options += ["--env", f"SPARROWRL_RUNTIME_IMAGE={RUNTIME}", "--env", "POD_NAMESPACE=default"]
        port = free_port()  # on the host's network: the probe's 8080 may be another test's
        argv = container(name, options, OPERATOR, [f"--liveness=http://0.0.0.0:{port}/healthz"])  # the last one counts
        p = subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            until(
                lambda: get(f"http://127.0.0.1:{port}/healthz") == 200,
                120,
                "the operator's health",
                every=0.2,
                alive={"operator": p},
            )
        finally:
            stop(name)
