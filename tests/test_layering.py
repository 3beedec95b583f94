"""The layering contract (pyproject.toml's [tool.importlinter], run by `make lint`) holds, and
breaks when a lower layer reaches up: checked on a copy of the tree with one import added."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"


def lint(tree: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{tree / 'runtime'}{os.pathsep}{tree / 'operator'}")
    return subprocess.run(
        [str(LINT), "--no-logo", "--no-cache", "--config", str(ROOT / "pyproject.toml")],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for top in ("runtime", "operator"):
        shutil.copytree(ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__", "Dockerfile"))
    return tmp_path


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        # a lazy import, inside a function, counts as much as one at the top
        (
            "spec/job.py",
            "def _reach_up():\n    from sparrowrl.store import store\n",
            "sparrowrl.spec.job -> sparrowrl.store.store",
        ),
        (
            "delta/frame.py",
            "from sparrowrl.transport import server\n",
            "sparrowrl.delta.frame -> sparrowrl.transport.server",
        ),
        ("auth/tokens.py", "import numpy\n", "sparrowrl.auth.tokens -> numpy"),
    ],
)
def test_a_lower_layer_that_reaches_up_breaks_the_contract(tree, module, line, broken):
    assert lint(tree).returncode == 0  # the copy as it is keeps every contract
    path = tree / "runtime" / "sparrowrl" / module
    path.write_text(path.read_text() + "\n\n" + line)
    p = lint(tree)
    assert p.returncode == 1 and "BROKEN" in p.stdout and broken in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]


def test_the_operator_may_not_import_the_runtime(tree):
    path = tree / "operator" / "sparrowrl_operator" / "builders.py"
    path.write_text(path.read_text() + "\n\nfrom sparrowrl.store import store  # noqa\n")
    p = lint(tree)
    assert p.returncode == 1 and "sparrowrl_operator is not allowed to import sparrowrl.store" in p.stdout, p.stdout
