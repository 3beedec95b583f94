"""Fail on any import cycle between modules of the packages that [tool.importlinter] lints, inside one
package as much as across layers (the layers contract sees only the latter). `make lint` runs it.

    python hack/check-cycles.py

Every import statement counts, wherever it is: one inside a function runs later, but the two
modules still need each other, and one under `if TYPE_CHECKING:` is a dependency of the design
(as the layers contract counts them too). A package's `__init__` is a module like any other: a
package that imports its submodules and a submodule that imports the package's names make a
cycle. Prints each cycle's modules and the imports between them, with their lines.

Not import-linter's `acyclic_siblings` contract: it compares a package's children only, so it
misses a cycle through the package's own `__init__`.
"""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent


def cycles(imports: Mapping[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in sorted(imports[m]):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = frozenset(stack[stack.index(m) :])
            del stack[stack.index(m) :]
            if len(component) > 1:
                found.append(component)

    for m in sorted(imports):
        if m not in index:
            visit(m)
    return found


def main() -> int:
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]
    graph = grimp.build_graph(*packages, cache_dir=None)
    imports = {m: graph.find_modules_directly_imported_by(m) - {m} for m in graph.modules}
    found = cycles(imports)
    for cycle in found:
        print(f"import cycle between {', '.join(sorted(cycle))}:")
        for importer in sorted(cycle):
            for imported in sorted(imports[importer] & cycle):
                for d in graph.get_import_details(importer=importer, imported=imported):
                    print(f"  {importer}:{d['line_number']} -> {imported}    {d['line_contents']}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
