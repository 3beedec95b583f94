#!/usr/bin/env python3
"""The wheels the GPU check carries to a machine where nothing can be fetched.

    python3 hack/gpu_wheels.py prepare .whl        # here, with a package index: download and check
    python3 hack/gpu_wheels.py install .whl SITE   # there: exactly the listed wheels, into SITE

hack/gpu-wheels.txt pins them; hack/gpu-image.txt lists what the GPU machine's image already has.
`prepare` refuses a set that the machine could not import: a pin without its wheel, two versions
of one package, or a requirement that neither another carried wheel nor a package of the image
(at a recorded version) meets. Only the standard library and `packaging` (pip's own copy where
it is not installed): `install` runs on the image's python3, before anything is carried in.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # a bare python3 that has pip: the same library, vendored
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

HACK = Path(__file__).resolve().parent
WHEELS, IMAGE = HACK / "gpu-wheels.txt", HACK / "gpu-image.txt"
# The GPU machine: CPython 3.12 on x86-64 Linux. pip matches manylinux tags exactly: name each.
PYTHON = "3.12"
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
TARGET = [
    "--only-binary=:all:",
    "--python-version",
    PYTHON,
    "--implementation",
    "cp",
    *(a for p in PLATFORMS for a in ("--platform", p)),
]
# What markers see there, for a requirement such as `cffi; python_version < "3.14"`.
ENVIRONMENT = default_environment() | {
    "python_version": PYTHON,
    "python_full_version": f"{PYTHON}.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}


class WheelError(Exception):
    pass


def pins(path: Path) -> dict[str, str]:
    """name → version (None where the list gives no version) from a list of `name[==version]`
    lines; `#` starts a comment."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version or None
    return out


def wheel_files(folder: Path, wanted: dict[str, str]) -> list[Path]:
    """The one wheel of each pin in `folder`; other versions of a pinned package there are refused
    (two versions stop the whole install), other packages' wheels are left alone."""
    found: dict[str, list[tuple[str, Path]]] = {}
    for f in sorted(folder.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(f.name)
        found.setdefault(canonicalize_name(name), []).append((str(version), f))
    out, problems = [], []
    for name, version in wanted.items():
        have = found.get(name, [])
        right = [f for v, f in have if v == version]
        if not right:
            problems.append(f"{name}=={version}: no wheel of it in {folder}")
        elif len(have) > 1:
            problems.append(
                f"{name}: {len(have)} versions in {folder} ({', '.join(f.name for _, f in have)}); "
                f"remove all but {right[0].name}"
            )
        else:
            out.append(right[0])
    if problems:
        raise WheelError("; ".join(problems))
    return out


def requirements(wheel: Path) -> list[Requirement]:
    """A wheel's Requires-Dist."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        headers = Parser().parsestr(z.read(meta).decode())
    return [Requirement(r) for r in headers.get_all("Requires-Dist") or []]


def applies(r: Requirement) -> bool:
    """Whether a requirement holds on the GPU machine (its markers there, no extras asked for)."""
    return r.marker is None or r.marker.evaluate(ENVIRONMENT | {"extra": ""})


def unmet(needs: dict[str, list[Requirement]], carried: dict[str, str], image: dict[str, str | None]) -> list[str]:
    """Requirements (of each carried wheel, by name) that nothing on the GPU machine would meet."""
    out = []
    for who, reqs in needs.items():
        for r in filter(applies, reqs):
            name = canonicalize_name(r.name)
            version = carried.get(name) or image.get(name)
            if version is None:
                where = "the image has it at a version not recorded" if name in image else "neither list has it"
                out.append(f"{who} needs {r} ({where}: add it to {WHEELS.name})")
            elif not r.specifier.contains(version, prereleases=True):
                out.append(
                    f"{who} needs {r}, and {name} is {version} ({'carried' if name in carried else 'on the image'})"
                )
    return out


def prepare(folder: Path) -> None:
    carried = pins(WHEELS)
    if None in carried.values():
        raise WheelError(f"{WHEELS.name}: every wheel needs an exact version (name==version)")
    folder.mkdir(exist_ok=True)
    spec = [f"{n}=={v}" for n, v in carried.items()]
    print(
        f"downloading {len(spec)} wheels for CPython {PYTHON} on x86-64 Linux into {folder}/: {' '.join(spec)}",
        flush=True,
    )
    run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *TARGET, "-d", str(folder), *spec])
    files = wheel_files(folder, carried)
    problems = unmet({f.name: requirements(f) for f in files}, carried, pins(IMAGE))
    if problems:
        raise WheelError("the carried wheels would not import on the GPU machine: " + "; ".join(problems))
    with tempfile.TemporaryDirectory() as site:  # as the machine will install them
        pip_install(files, Path(site), *TARGET)
    for f in files:
        print(f"  {f.name}  {f.stat().st_size / 1e6:.1f} MB")
    print(
        f"ready: {len(files)} wheels, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB; carry {folder}/ with "
        f"the checkout and run `bash hack/gpu-check.sh` there"
    )


def install(folder: Path, site: Path) -> None:
    try:
        files = wheel_files(folder, pins(WHEELS))
    except WheelError as e:
        raise WheelError(
            f"{e}. Run `bash hack/gpu-check.sh --prepare` where there is a package index, and "
            f"carry {folder}/ with the checkout"
        ) from None
    pip_install(files, site)
    print(f"installed {len(files)} carried wheels into {site}", flush=True)


def pip_install(files: list[Path], site: Path, *tags: str) -> None:
    """The wheels together, without an index or their dependencies, into `site` (`tags`: for
    another interpreter than this one)."""
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            *tags,
            "--target",
            str(site),
            *map(str, files),
        ]
    )


def run(argv: list[str]) -> None:
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode:
        raise WheelError(f"{' '.join(argv[2:4])} failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-4000:]}")


def main() -> None:
    args = sys.argv[1:]
    try:
        if len(args) == 2 and args[0] == "prepare":
            prepare(Path(args[1]))
        elif len(args) == 3 and args[0] == "install":
            install(Path(args[1]), Path(args[2]))
        else:
            sys.exit(__doc__)
    except WheelError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
