#!/usr/bin/env python3
"""The images' figures for docs/operator.md (Images): each image's size and layers, and the time
from `run` to `/healthz`, beside the same process started from the repo's venv on this machine
in the same run (what the container adds). Build them first: `make images`.

The runtime image is timed as a trainer of a tiny job (its /healthz answers once it listens,
before the model loads) and as a relay; the operator image logged in to an emulated cluster
(tests/support/kube.py), as tests/test_images.py runs it.

    python3 hack/bench_images.py [--tag 0.1.0] [--repeat 3] [--out docs/bench_images.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import in_venv  # noqa: E402 (hack/ is this script's folder, first on sys.path)

in_venv.enter()

import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from support.bounded import free_port  # noqa: E402
from support.kube import clusters  # noqa: E402

ENV = {
    **os.environ,
    "CONTAINERS_CONF": str(ROOT / "hack" / "containers.conf"),
    "CONTAINERS_STORAGE_CONF": str(ROOT / "hack" / "storage.conf"),
}
JOB = {
    "apiVersion": "sparrowrl.dev/v1alpha1",
    "kind": "SparrowRLJob",
    "metadata": {"name": "bench"},
    "spec": {"steps": 1, "model": {"tiny": {"hidden": 32, "layers": 1, "heads": 2}}, "task": {"builtin": "add"}},
}


def engine() -> str:
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return "docker"
    return "podman"


def until_healthy(url: str, p: subprocess.Popen, t0: float, limit: float = 300) -> float:
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            pass
        if p.poll() is not None or time.perf_counter() - t0 > limit:
            raise RuntimeError(f"{url}: no answer ({p.args[:6]}): {p.stdout.read()[-2000:] if p.stdout else ''}")
        time.sleep(0.05)


def timed(argv: list[str], url: str, cleanup: list[str] | None = None, env: dict | None = None) -> float:
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        return until_healthy(url, p, t0)
    finally:
        if cleanup:
            subprocess.run(cleanup, env=ENV, capture_output=True, timeout=60)
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def layers(tool: str, image: str) -> dict:
    info = json.loads(subprocess.run([tool, "image", "inspect", image], env=ENV, capture_output=True,
                                     text=True, check=True).stdout)[0]  # fmt: skip
    hist = subprocess.run([tool, "history", "--format", "{{.Size}}\t{{.CreatedBy}}", image], env=ENV,
                          capture_output=True, text=True, check=True).stdout.splitlines()  # fmt: skip
    sized = [h.split("\t", 1) for h in hist if not h.startswith(("0 B", "0B"))]
    return {
        "bytes": info["Size"],
        "layers": len(info["RootFS"]["Layers"]),
        "labels": {k: v for k, v in (info.get("Labels") or info["Config"].get("Labels") or {}).items()},
        "history": [{"size": s, "step": c[:120]} for s, c in sized],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tag", default="0.1.0")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "docs/bench_images.json"))
    a = ap.parse_args()
    tool = engine()
    runtime = f"localhost/sparrowrl/sparrowrl-runtime:{a.tag}"
    operator = f"localhost/sparrowrl/sparrowrl-operator:{a.tag}"
    venv = ROOT / ".venv" / "bin"
    res: dict = {"date": time.strftime("%Y-%m-%d"), "engine": tool, "images": {}, "start_s": {}}
    for image in (runtime, operator):
        res["images"][image] = layers(tool, image)
    with tempfile.TemporaryDirectory() as tmp, clusters("bench") as (home,):
        top = Path(tmp)
        top.chmod(0o755)
        (top / "job.yaml").write_text(yaml.safe_dump(JOB))
        (top / "job.yaml").chmod(0o644)
        (top / "kube").mkdir(mode=0o755)
        (top / "kube" / "config").write_text(yaml.safe_dump(home.kubeconfig()))
        (top / "kube" / "config").chmod(0o644)
        run = [tool, "run", "--rm", "--network", "host", "--read-only", "--tmpfs", "/tmp", "--user", "65532:65532"]
        cases = {}
        for i in range(a.repeat):
            port, state = free_port(), top / f"state-{i}"
            state.mkdir()
            os.chown(state, 65532, 65532)
            name = f"bench-trainer-{i}"
            args = ["trainer", "/job/job.yaml", "--state-dir", "/state", "--port", str(port)]
            cases.setdefault("trainer, container", []).append(timed(
                [*run, "--name", name, "-v", f"{top}:/job:ro", "-v", f"{state}:/state", runtime, *args],
                f"http://127.0.0.1:{port}/healthz", [tool, "rm", "-f", name]))  # fmt: skip
            port = free_port()
            args = ["trainer", str(top / "job.yaml"), "--state-dir", str(top / f"native-{i}"), "--port", str(port)]
            url = f"http://127.0.0.1:{port}/healthz"
            cases.setdefault("trainer, venv", []).append(timed([str(venv / "sparrowrl"), *args], url, env=os.environ))
            name = f"bench-operator-{i}"
            opts = ["-v", f"{top / 'kube'}:/kube:ro", "-e", "KUBECONFIG=/kube/config", "-e", "POD_NAMESPACE=default"]
            port = free_port()  # the image's probe is on 8080: on the host's network, a free port instead
            live = f"--liveness=http://0.0.0.0:{port}/healthz"
            cases.setdefault("operator, container", []).append(timed([*run, "--name", name, *opts, operator, live],
                f"http://127.0.0.1:{port}/healthz", [tool, "rm", "-f", name]))  # fmt: skip
            kopf = ["kopf", "run", "--standalone", "--all-namespaces", live, "-m", "sparrowrl_operator.main"]
            env = {**os.environ, "KUBECONFIG": str(top / "kube" / "config"), "POD_NAMESPACE": "default"}
            kopf[0] = str(venv / "kopf")
            cases.setdefault("operator, venv", []).append(timed(kopf, f"http://127.0.0.1:{port}/healthz", env=env))
        res["start_s"] = {k: {"median": statistics.median(v), "runs": v} for k, v in cases.items()}
    Path(a.out).write_text(json.dumps(res, indent=1))
    for image, x in res["images"].items():
        print(f"{image}: {x['bytes'] / 1e6:,.0f} MB in {x['layers']} layers")
        for h in x["history"]:
            print(f"    {h['size']:>10}  {h['step']}")
    for k, v in res["start_s"].items():
        print(f"{k:<22} to /healthz: median {v['median']:.2f} s ({', '.join(f'{x:.2f}' for x in v['runs'])})")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
