"""The layering contract (pyproject.toml's [tool.importlinter]), the import cycle check
(hack/check-cycles.py) and the types ([tool.mypy]), all run by `make lint`, hold, and break when a
lower layer reaches up, two modules import each other or a type is wrong: checked on a copy of the
tree with one import, or one function, added."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"
MYPY = Path(sys.executable).parent / "mypy"


def run(tree: Path, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{tree / 'runtime'}{os.pathsep}{tree / 'operator'}")
    return subprocess.run(
        argv,
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def lint(tree: Path) -> subprocess.CompletedProcess:
    return run(tree, str(LINT), "--no-logo", "--no-cache", "--config", str(ROOT / "pyproject.toml"))


def check_cycles(tree: Path) -> subprocess.CompletedProcess:
    return run(tree, sys.executable, str(ROOT / "hack" / "check-cycles.py"))


def typecheck(tree: Path) -> subprocess.CompletedProcess:
    """mypy as `make lint` runs it, on `tree`'s packages (its config's paths are the working
    directory's), with the cache there."""
    return run(tree, str(MYPY), "--config-file", str(ROOT / "pyproject.toml"))


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


@pytest.mark.parametrize(
    ("module", "line", "cycle"),
    [
        # two modules of one package, one of them importing the other inside a function
        (
            "delta/bitview.py",
            "def _back():\n    from sparrowrl.delta import statehash\n",
            "sparrowrl.delta.bitview, sparrowrl.delta.statehash:",
        ),
        (
            "integrations/vllm_cpu.py",
            "from sparrowrl.integrations import vllm_plugin\n",
            "sparrowrl.integrations.vllm_backend, sparrowrl.integrations.vllm_cpu, sparrowrl.integrations.vllm_plugin:",
        ),
        # a package's __init__ is one module among the others: it imports errors through frame
        ("delta/errors.py", "from sparrowrl.delta import DeltaFile\n", "sparrowrl.delta, sparrowrl.delta.apply, "),
    ],
)
def test_two_modules_that_import_each_other_fail_the_cycle_check(tree, module, line, cycle):
    assert check_cycles(tree).returncode == 0  # the copy as it is has no cycle
    path = tree / "runtime" / "sparrowrl" / module
    path.write_text(path.read_text() + "\n\n" + line)
    p = check_cycles(tree)
    importer = "sparrowrl." + module.removesuffix(".py").replace("/", ".")
    assert p.returncode == 1 and f"import cycle between {cycle}" in p.stdout, p.stdout + p.stderr
    assert f"{importer}:" in p.stdout and line.splitlines()[-1].strip() in p.stdout, p.stdout


@pytest.mark.parametrize(
    ("module", "code", "at", "error"),
    [
        # a strict package's function that returns what it does not declare
        (
            "delta/extract.py",
            'def _wrong() -> int:\n    return "x"\n',
            1,
            'error: Incompatible return value type (got "str", expected "int")  [return-value]',
        ),
        # in a strict package every function is annotated (elsewhere, as in cli/ below, one need not be)
        ("spec/job.py", "def _untyped(x):\n    return x\n", 0, "error: Function is missing a type annotation"),
        # basic mode checks the bodies of the rest too, annotated or not
        (
            "cli/report.py",
            "def _body():\n    return len(1)\n",
            1,
            'error: Argument 1 to "len" has incompatible type "int"',
        ),
    ],
)
def test_a_wrong_type_fails_the_type_check(tree, module, code, at, error):
    if (ROOT / ".mypy_cache").is_dir():  # torch's types and the rest, analysed once: a minute cold
        shutil.copytree(ROOT / ".mypy_cache", tree / ".mypy_cache")
    lenient = tree / "runtime" / "sparrowrl" / "cli" / "job.py"
    lenient.write_text(lenient.read_text() + "\n\ndef _unannotated(x):\n    return x\n")
    path = tree / "runtime" / "sparrowrl" / module
    before = path.read_text() + "\n\n"
    path.write_text(before + code)
    p = typecheck(tree)
    where = f"runtime/sparrowrl/{module}:{before.count(chr(10)) + 1 + at}: "
    assert p.returncode == 1 and f"{where}{error}" in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]
    # the rest of the copy checks clean (make lint checks the tree itself), the unannotated cli/ function too
    assert "Found 1 error in 1 file" in p.stdout, p.stdout[-3000:]


def test_no_module_is_over_500_lines():
    """A module a newcomer reads in one sitting: past 500 lines, split it by concern."""
    sources = [*(ROOT / "runtime" / "sparrowrl").rglob("*.py"), *(ROOT / "operator").rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > 500}
    assert len(sources) > 100 and not long, long
