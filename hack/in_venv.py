"""For the benchmarks under hack/: run them with the repo's .venv, made on first use, whatever
python3 started them (`sudo python3 hack/bench_e2e.py` starts the system's)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def enter() -> None:
    """Re-run this script under ROOT/.venv, after `make` has set it up if needed; unless this
    python already has sparrowrl and torch (a GPU machine's, given PYTHONPATH by gpu-check.sh)."""
    venv = ROOT / ".venv"
    if Path(sys.prefix).resolve() == venv.resolve() or all(
        importlib.util.find_spec(m) is not None for m in ("sparrowrl", "torch")
    ):
        return
    subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", ".venv/.installed"], check=True)
    python = venv / "bin" / "python"
    os.execv(python, [str(python), *sys.argv])
