"""hack/gpu-check.sh must work the first time on the GPU machine's image, where nothing can be
installed: everything its parts import is on that image (hack/gpu-image.txt) or among the wheels
it carries (hack/gpu-wheels.txt). Checked twice: statically, over every import of every file
the parts run and of the package modules those reach (lazy imports included); and by running
the check here on an image made of exactly those packages, every other one absent."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
LOCAL = [ROOT / "runtime", ROOT / "operator", ROOT / "tests", ROOT / "hack"]  # our own modules live here
sys.path.insert(0, str(ROOT / "hack"))
import gpu_check  # noqa: E402
import gpu_wheels  # noqa: E402


def image() -> dict[str, str | None]:
    return gpu_wheels.pins(gpu_wheels.IMAGE)


def carried() -> dict[str, str]:
    return gpu_wheels.pins(gpu_wheels.WHEELS)


def on_the_machine() -> set[str]:
    return set(image()) | set(carried())


# Modules that only a job feature no part of the check uses needs, imported inside the function
# that uses it: the image may lack them (checked: never imported at a module's top level).
OPTIONAL = {
    "datasets": "task.dataset, a job's Hugging Face data set",
    "httpx2": "the errors of huggingface_hub 2 (the image's is 1.x), only for a model or data set from the hub",
    "verifiers": "task.environment of verifiers' own (agents/classic.py), sparrowrl[verifiers]",
}


def check_files() -> list[Path]:
    """What the check runs on the image: the parts whose modules the image can have (not the vLLM
    engine's: vLLM cannot be carried, and that part says skipped), pytest's conftest, the driver."""
    files = [ROOT / "hack" / "gpu_check.py", ROOT / "hack" / "gpu_wheels.py"]
    for part in gpu_check.PARTS:
        if not all(n == "cuda" or provided(n) for n in part.needs):
            continue
        for f in part.files:
            p = ROOT / f
            files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
        if part.pytest:
            files.append(ROOT / "tests" / "conftest.py")
    return files


@functools.cache
def _providers() -> dict[str, list[str]]:
    """Top-level module → distributions: a scan of every installed package, so made once."""
    return importlib.metadata.packages_distributions()


def provided(module: str) -> bool:
    """Whether a distribution on the machine's lists gives this top-level module."""
    dists = _providers().get(module, [])
    return any(canonicalize_name(d) in on_the_machine() for d in dists)


def _local(name: str) -> Path | None:
    parts = name.split(".")
    for base in LOCAL:
        p = base.joinpath(*parts)
        if p.with_suffix(".py").is_file():
            return p.with_suffix(".py")
        if (p / "__init__.py").is_file():
            return p / "__init__.py"
    return None


def _imported(tree: ast.AST, path: Path) -> list[str]:
    """Every module name a file may import: import statements anywhere (in functions too, but
    not under `if TYPE_CHECKING`), and the literal names given to importorskip/import_module."""
    out = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's own package
                pkg = path.parent.relative_to(next(b for b in LOCAL if path.is_relative_to(b))).parts
                base = ".".join([*pkg[: len(pkg) - node.level + 1], *([base] if base else [])])
            out += [base] + [f"{base}.{a.name}" for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("importorskip", "import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            out.append(node.args[0].value)
        todo.extend(ast.iter_child_nodes(node))
    return [n for n in out if n]


def third_party(files: list[Path]) -> tuple[dict[str, set[str]], list[Path]]:
    """Third-party top-level modules → the files that import them, over `files` and every module
    of ours they reach (a package's __init__ included); and those modules of ours."""
    found: dict[str, set[str]] = {}
    seen: list[Path] = []
    todo = list(files)
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.append(f)
        for name in _imported(ast.parse(f.read_text()), f):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top == "__future__":
                continue
            parts = name.split(".")
            mine = [p for p in (_local(".".join(parts[:i])) for i in range(1, len(parts) + 1)) if p]
            if mine:
                todo += mine
            else:
                found.setdefault(top, set()).add(str(f.relative_to(ROOT) if f.is_relative_to(ROOT) else f))
    return found, seen


def off_the_machine(files: list[Path]) -> list[str]:
    """The imports of `files` (and what they reach) that neither list provides, with their files."""
    found, _ = third_party(files)
    problems = []
    for top, where in sorted(found.items()):
        if top in OPTIONAL:
            continue
        dists = _providers().get(top)
        if not dists:
            problems.append(
                f"{top} (no installed distribution provides it, so its package cannot be checked), "
                f"imported by {sorted(where)}"
            )
        elif not provided(top):
            problems.append(
                f"{top} (from {', '.join(dists)}: on neither hack/gpu-image.txt nor hack/gpu-wheels.txt), "
                f"imported by {sorted(where)}"
            )
    return problems


def with_requirements(names: set[str]) -> set[str]:
    """`names` and what they require as installed here, transitively (without extras)."""
    out, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        try:
            reqs = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for r in map(Requirement, reqs):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(r.name))
    return out


def fake_image(folder: Path) -> Path:
    """A site folder holding only the installed distributions that the GPU machine will have,
    linked from this environment (modules and metadata): the carried wheels, and the image's
    packages with what they need here (their versions here may need other packages than the
    image's versions do; the image brings its own)."""
    folder.mkdir()
    wanted = with_requirements(set(image())) | set(carried())
    for dist in importlib.metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in wanted:
            continue
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"__pycache__", "bin"}:
            src = Path(dist.locate_file(top))
            if src.exists() and not (folder / top).exists():
                (folder / top).symlink_to(src)
    return folder


def on_fake_image(site: Path, argv: list[str], env: dict | None = None, timeout: int = 300):
    """Run this python without its site-packages (-S), with the fake image, the repo's runtime/
    (as hack/gpu-check.sh gives it), tests/ and hack/ on its path."""
    path = os.pathsep.join(map(str, [site, ROOT / "runtime", ROOT / "tests", ROOT / "hack"]))
    return subprocess.run(
        [sys.executable, "-S", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        | {"PYTHONPATH": path}
        | (env or {}),
    )


IMPORT_ALL = """
import importlib, importlib.util, sys
from pathlib import Path
failed = []
for f in sys.argv[1:]:
    p = Path(f)
    parts = p.with_suffix("").parts
    try:
        if "runtime" in parts:  # a package module, by its dotted name
            name = ".".join(parts[parts.index("runtime") + 1:]).removesuffix(".__init__")
            importlib.import_module(name)
        else:  # a test file or a script, by its path
            spec = importlib.util.spec_from_file_location(p.stem, p)
            module = importlib.util.module_from_spec(spec)
            sys.modules[p.stem] = module
            spec.loader.exec_module(module)
    except BaseException as e:  # pytest.skip is a BaseException
        failed.append(f"{f}: {type(e).__name__}: {e}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_import_of_the_check_is_on_the_image_or_carried():
    files = check_files()
    assert ROOT / "tests" / "test_gpu.py" in files and ROOT / "hack" / "bench_gpu.py" in files
    assert not any("engine_vllm" in str(f) for f in files)  # the part that needs vLLM says skipped
    found, reached = third_party(files)
    assert {"torch", "cupy", "pydantic", "zstandard", "numba"} <= found.keys()  # the analysis sees lazy imports too
    assert ROOT / "runtime" / "sparrowrl" / "delta" / "gpu.py" in reached
    assert off_the_machine(files) == []


def test_optional_modules_are_imported_only_where_they_are_used():
    _, reached = third_party(check_files())
    assert ROOT / "runtime" / "sparrowrl" / "trainer" / "tasks.py" in reached  # where `datasets` is used
    for f in reached:
        for node in ast.parse(f.read_text()).body:  # the module's top level
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not [n for n in names if n.split(".")[0] in OPTIONAL], f"{f}: imports an optional module at the top"


def test_the_carried_wheels_are_the_versions_tested_here():
    """The fake image links this environment's packages: for it to stand for the machine, the
    wheels it stands in for must be the same versions; and none is pinned twice or left unpinned."""
    wheels = carried()
    assert all(wheels.values())
    for name, version in wheels.items():
        assert importlib.metadata.version(name) == version, f"{name}: this environment has another version"
    text = gpu_wheels.WHEELS.read_text().splitlines()
    assert len([ln for ln in text if ln.split("#")[0].strip()]) == len(wheels)


def test_what_the_carried_wheels_need_is_carried_or_on_the_image():
    """What `--prepare` checks in the downloaded wheels, from the same versions' metadata here."""
    needs = {n: list(map(Requirement, importlib.metadata.requires(n) or [])) for n in carried()}
    assert gpu_wheels.unmet(needs, carried(), image()) == []
    # without pydantic-core, pydantic would not import there
    less = {n: v for n, v in carried().items() if n != "pydantic-core"}
    assert gpu_wheels.unmet(needs, less, image()) == [
        "pydantic needs pydantic-core==2.50.4 (neither list has it: add it to gpu-wheels.txt)"
    ]


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_the_check_runs_on_an_image_of_only_those_packages(tmp_path):
    """Every module of the check imports with every other package absent, and the check itself
    runs: here without CUDA, its GPU parts say skipped and why, the others pass on the CPU."""
    site = fake_image(tmp_path / "site")
    _, reached = third_party(check_files())
    p = on_fake_image(site, ["-c", IMPORT_ALL, *map(str, reached)])
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    out = tmp_path / "out"
    p = on_fake_image(site, [str(ROOT / "hack" / "gpu_check.py")], {"OUT": str(out)}, timeout=500)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    status = {r["part"]: (r["status"], r["why"]) for r in summary["parts"]}
    assert status.keys() == {part.name for part in gpu_check.PARTS}
    assert status["codec"][0] == "passed" and status["bench-shard"][0] == "passed"
    assert all(status[n] == ("skipped", "no CUDA device") for n in ("gpu-tests", "bench-gpu"))
    assert status["vllm-gpu"][0] == "skipped" and gpu_check.VLLM_WHY in status["vllm-gpu"][1]
    for name, (st, why) in status.items():  # one summary line per part
        assert sum(line.endswith(f" {name}: {why}") and st.upper() in line for line in p.stdout.splitlines()) == 2
    written = [f.name for f in out.rglob("*") if f.is_file()]
    assert set(written) <= set(gpu_check.OUTPUTS) and len(gpu_check.OUTPUTS) <= 8
    assert json.loads((out / "bench_shard.json").read_text())["runs"]["1"][0]["steps"]


@pytest.mark.e2e
def test_a_dependency_on_neither_list_is_caught_both_ways(tmp_path):
    """A part that imports kopf (installed here, on neither list) lazily, inside a function: the
    static pass names it, and on the fake image the import fails."""
    part = tmp_path / "part.py"
    part.write_text(
        "from sparrowrl.delta import frame\n\n\ndef later():\n    import kopf\n    return kopf\n\n\nlater()\n"
    )
    problems = off_the_machine(check_files() + [part])
    assert len(problems) == 1 and problems[0].startswith("kopf (from kopf: on neither") and str(part) in problems[0]
    assert importlib.util.find_spec("kopf") is not None  # it is installed here: only the lists make it wrong
    p = on_fake_image(fake_image(tmp_path / "site"), [str(part)])
    assert p.returncode == 1 and "ModuleNotFoundError: No module named 'kopf'" in p.stderr, p.stderr[-2000:]


def test_the_install_takes_exactly_the_pinned_wheels(tmp_path):
    """Two versions of one package would stop the whole install there, and a missing one would
    fail an import minutes later: both are refused by name before anything is installed."""
    pinned = {"zstandard": "0.25.0"}
    tag = "cp312-cp312-manylinux2014_x86_64.whl"
    (tmp_path / f"zstandard-0.25.0-{tag}").touch()
    (tmp_path / "other-1.0-py3-none-any.whl").touch()  # someone else's: left alone
    assert [f.name for f in gpu_wheels.wheel_files(tmp_path, pinned)] == [f"zstandard-0.25.0-{tag}"]
    (tmp_path / f"zstandard-0.24.0-{tag}").touch()
    with pytest.raises(gpu_wheels.WheelError, match=r"zstandard: 2 versions in .*; remove all but zstandard-0.25.0"):
        gpu_wheels.wheel_files(tmp_path, pinned)
    with pytest.raises(gpu_wheels.WheelError, match=r"pydantic==2.14.3: no wheel of it in"):
        gpu_wheels.wheel_files(tmp_path, {"pydantic": "2.14.3"})
