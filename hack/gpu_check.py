#!/usr/bin/env python3
"""The GPU check's parts, run one after another by hack/gpu-check.sh under the GPU machine's own
python3 (its torch, CuPy and numba; the carried wheels first on PYTHONPATH).

Each part runs in a process of its own under a deadline, so a hang costs its share of the
machine's minutes, not the rest, and the whole check ends within BUDGET_S. One line per part
says passed, failed or skipped, and why. Everything measured goes under $OUT (default gpu-out/)
in the OUTPUTS files: the device machine brings back at most 8. Without CUDA (here), the parts
that need it say skipped and the rest run on the CPU, at the sizes `cpu_args` gives.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 330  # under the 6 minutes one run of the check may take, with the machine's start beside it
OUTPUTS = ("summary.json", "check.log", "bench_gpu.json", "bench_shard.json", "bench_microbatch.json")
VLLM_WHY = (
    "vLLM is not installed on this machine and cannot be carried there (its wheel is far over the "
    "64 MiB one run may bring): the vLLM engine's GPU route stays unverified, and with it its "
    "batched leases, sampling settings and tensor parallelism on GPUs"
)


@dataclass(frozen=True)
class Part:
    name: str
    what: str
    files: tuple[str, ...]  # test files (run by pytest) or one script, relative to the repo root
    timeout_s: int
    needs: tuple[str, ...] = ()  # "cuda", or modules that must be importable
    gpu_args: tuple[str, ...] = ()
    cpu_args: tuple[str, ...] = ()
    why_missing: dict[str, str] = field(default_factory=dict)  # a need → what its absence means

    @property
    def pytest(self) -> bool:
        return self.files[0].startswith("tests/")


PARTS = (
    Part(
        "codec",
        "the codec's tests on this machine's torch, numpy and numba (CPU)",
        ("tests/test_roundtrip.py", "tests/test_layout.py", "tests/test_statehash.py"),
        100,
    ),
    Part(
        "gpu-tests",
        "CUDA inputs give the CPU's delta bytes, device hash = host hash, in-place apply into "
        "fused CUDA views, the sharded trainer's NCCL route",
        ("tests/test_gpu.py",),
        150,
        ("cuda", "cupy"),
    ),
    Part(
        "trainer-gpu",
        "one trainer rank on the GPU: bf16 compute over fp32 master weights and AdamW state, micro-batches, "
        "a schedule; its policy is the CPU's bf16 cast bit for bit, its checkpoints load on the CPU",
        ("tests/test_trainer_gpu.py",),
        120,
        ("cuda", "cupy"),
    ),
    Part(
        "vllm-gpu",
        "the vLLM engine's in-place GPU route, a lease in one call, top-k/top-p/stop strings, "
        "tensor parallelism where there are two GPUs, and vllm serve's sparrowrl backend (deltas "
        "in place into CUDA views)",
        ("tests/engine_vllm",),
        240,
        ("cuda", "vllm"),
        why_missing={"vllm": VLLM_WHY},
    ),
    Part(
        "bench-gpu",
        "diff, encode and state hash of 2^30 bf16 elements beside the device copy",
        ("hack/bench_gpu.py",),
        100,
        ("cuda", "cupy"),
        gpu_args=("--out", "{out}/bench_gpu.json"),
    ),
    Part(
        "bench-shard",
        "the sharded trainer's step-to-published beside memcpy (FSDP2; NCCL on GPUs; 2 nodes of 1 GPU too)",
        ("hack/bench_shard.py",),
        120,
        gpu_args=("--layouts", "{ranks}", "--json", "{out}/bench_shard.json"),
        cpu_args=(
            "--ranks",
            "1",
            "--hidden",
            "256",
            "--layers",
            "2",
            "--steps",
            "2",
            "--json",
            "{out}/bench_shard.json",
        ),
    ),
    Part(
        "bench-microbatch",
        "peak GPU memory of one training step at Qwen3's vocabulary, one pass beside micro-batches",
        ("hack/bench_microbatch.py",),
        120,
        ("cuda",),
        gpu_args=(
            "--vocab",
            "151936",
            "--hidden",
            "1024",
            "--layers",
            "8",
            "--rows",
            "32",
            "--prompt",
            "256",
            "--completion",
            "512",
            "--budgets",
            "8192,2048",
            "--out",
            "{out}/bench_microbatch.json",
        ),
    ),
)


def have(need: str) -> bool:
    if need == "cuda":
        import torch

        return torch.cuda.is_available()
    return importlib.util.find_spec(need) is not None


def environment() -> dict:
    import numpy
    import torch

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "numpy": numpy.__version__,
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    for m in ("numba", "cupy"):
        try:
            env[m] = __import__(m).__version__
        except ImportError:
            env[m] = None
    if env["cuda_devices"]:
        env["device"] = torch.cuda.get_device_name()
        try:
            env["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            env["nvidia_smi"] = f"not run: {e}"
    return env


def command(part: Part, out: Path, junit: Path, gpu: bool, ranks: str) -> list[str]:
    if part.pytest:
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *part.files]
    args = part.gpu_args if gpu else part.cpu_args
    return [sys.executable, part.files[0], *(a.format(out=out, ranks=ranks) for a in args)]


def run(argv: list[str], log, timeout_s: float) -> tuple[int | None, str]:
    """(exit code or None on timeout, the output's tail); the whole output goes to `log`."""
    with tempfile.TemporaryFile("w+") as buf:
        p = subprocess.Popen(argv, cwd=ROOT, stdout=buf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            code = None
        buf.seek(0)
        text = buf.read()
    log.write(text)
    log.flush()
    return code, "\n".join(text.splitlines()[-40:])


def pytest_result(junit: Path) -> dict:
    suites = ET.parse(junit).getroot()
    counts = {
        k: sum(int(s.get(k, 0)) for s in suites.iter("testsuite")) for k in ("tests", "failures", "errors", "skipped")
    }
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    reasons = {s.get("message", "") for s in suites.iter("skipped")}
    counts["skip_reasons"] = sorted(r for r in reasons if r)[:5]
    return counts


def judge(part: Part, code: int | None, junit: Path, took: float, timeout_s: float) -> tuple[str, str]:
    if code is None:
        return "failed", f"timed out after {timeout_s:.0f} s"
    if not part.pytest:
        return ("passed", f"in {took:.0f} s") if code == 0 else ("failed", f"exit code {code}")
    if not junit.exists():
        return "failed", f"pytest exit code {code}, no report"
    r = pytest_result(junit)
    said = f"{r['passed']} passed, {r['failures'] + r['errors']} failed, {r['skipped']} skipped in {took:.0f} s"
    if r["failures"] or r["errors"] or code not in (0, 5):
        return "failed", said
    if not r["passed"]:
        return "skipped", f"every test skipped: {'; '.join(r['skip_reasons']) or 'no reason given'}"
    return "passed", said


def main() -> int:
    out = Path(os.environ.get("OUT") or ROOT / "gpu-out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    env = environment()
    gpu = env["cuda_devices"] > 0
    ranks = "1,2,2x1,2x1h" if env["cuda_devices"] >= 2 else "1"  # 2x1: two nodes (NCCL across process groups)
    print(
        f"gpu-check: python {env['python']}, torch {env['torch']} (CUDA {env['torch_cuda']}), numpy {env['numpy']}, "
        f"numba {env['numba']}, cupy {env['cupy']}; "
        + (f"{env['cuda_devices']} x {env['device']} ({env.get('nvidia_smi', '')})" if gpu else "no CUDA device"),
        flush=True,
    )
    results = []
    with open(out / "check.log", "w") as log, tempfile.TemporaryDirectory() as tmp:
        for i, part in enumerate(PARTS, 1):
            left = BUDGET_S - (time.monotonic() - start)
            missing = [n for n in part.needs if not have(n)]
            timeout_s = min(part.timeout_s, left - 5)
            if missing:
                status = "skipped"
                why = "; ".join(
                    part.why_missing.get(n, "no CUDA device" if n == "cuda" else f"{n} is not installed")
                    for n in missing
                )
                took = 0.0
            elif timeout_s < 20:
                status, why, took = "skipped", f"the check's {BUDGET_S} s were spent before it", 0.0
            else:
                print(f"[{i}/{len(PARTS)}] {part.name}: {part.what} ...", flush=True)
                junit = Path(tmp) / f"{part.name}.xml"
                argv = command(part, out, junit, gpu, ranks)
                log.write(f"\n===== {part.name}: {' '.join(argv)}\n")
                log.flush()
                t0 = time.monotonic()
                code, tail = run(argv, log, timeout_s)
                took = time.monotonic() - t0
                status, why = judge(part, code, junit, took, timeout_s)
                if status == "failed":
                    print(tail, flush=True)
            line = f"{status.upper():7} {part.name}: {why}"
            print(f"[{i}/{len(PARTS)}] {line}", flush=True)
            log.write(line + "\n")
            results.append(
                {"part": part.name, "what": part.what, "status": status, "why": why, "seconds": round(took, 1)}
            )
    summary = {"environment": env, "parts": results, "seconds": round(time.monotonic() - start, 1)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    extra = sorted(p.name for p in out.rglob("*") if p.is_file() and p.name not in OUTPUTS)
    print("\nsummary (also in summary.json; every part's output in check.log):")
    for r in results:
        print(f"  {r['status'].upper():7} {r['part']}: {r['why']}")
    if extra:
        print(f"  note: {out} also holds {extra}, from before this run (the device brings back 8 files at most)")
    print(f"  {summary['seconds']:.0f} s in all")
    return 1 if any(r["status"] == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
