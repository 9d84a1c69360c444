"""The import graph of aerie's packages, read from the source with `ast` (nothing is imported).

    python scripts/import_graph.py            # the graph, one module per line, and the checks
    python scripts/import_graph.py --check    # only the checks; exit 1 when one fails

Every `import` counts, at module level or inside a function. The checks (ARCHITECTURE.md, "Packages and services"):
- no import cycle between aerie's modules;
- a service imports no other service's package (the store is the only interface between them);
- the shared library imports no service package (services plug in through entry points);
- the core (`aerie` outside `aerie.app`) imports neither the app nor the app's libraries (click,
  rich, subprocess): worker images run the core, the operator's commands are the app.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {  # top-level package -> (source root, owner)
    "aerie": (REPO / "shared", "shared"),
    "aerie_extractor": (REPO / "services" / "extractor", "extractor"),
    "aerie_trainer": (REPO / "services" / "trainer", "trainer"),
    "aerie_sglang": (REPO / "services" / "inference", "inference"),
}


def modules() -> dict[str, Path]:
    found = {}
    for package, (root, _) in PACKAGES.items():
        for path in sorted((root / package).rglob("*.py")):
            if "shim" in path.parts:  # a stand-in for sgl_kernel, loaded by SGLang's processes
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """aerie modules `name` imports (resolved to the longest known module name)."""
    out = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            parts = target.split(".")
            for n in range(len(parts), 0, -1):
                candidate = ".".join(parts[:n])
                if candidate in known:
                    if candidate != name:
                        out.add(candidate)
                    break
    return out


CORE_FORBIDDEN = ("click", "rich", "subprocess")


def top_level_imports(path: Path) -> set[str]:
    """The top-level names of every absolute import in `path` (at module level or in a function)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def is_core(module: str) -> bool:
    return module.split(".")[0] == "aerie" and module != "aerie.app" and not module.startswith("aerie.app.")


def core_problems(mods: dict[str, Path] | None = None, g: dict[str, set[str]] | None = None) -> list[str]:
    """The core's imports of the app (`aerie.app`) or of the app's libraries (CORE_FORBIDDEN)."""
    mods = modules() if mods is None else mods
    g = graph() if g is None else g
    found = []
    for module in sorted(m for m in g if is_core(m)):
        for dep in sorted(d for d in g[module] if not is_core(d) and owner(d) == "shared"):
            found.append(f"{module} (core) imports {dep} (app): the core runs without the app")
        for name in sorted(top_level_imports(mods[module]) & set(CORE_FORBIDDEN)):
            found.append(f"{module} (core) imports {name}: the core runs without the app's libraries")
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def owner(module: str) -> str:
    return PACKAGES[module.split(".")[0]][1]


def problems(g: dict[str, set[str]]) -> list[str]:
    found = [f"import cycle: {' <-> '.join(c)}" for c in cycles(g)]
    for module, deps in sorted(g.items()):
        for dep in sorted(deps):
            a, b = owner(module), owner(dep)
            if a != b and b != "shared":
                found.append(f"{module} ({a}) imports {dep} ({b}): services meet only through the store")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="print only the problems")
    args = ap.parse_args()
    g = graph()
    if not args.check:
        for module in sorted(g):
            print(f"{module} -> {', '.join(sorted(g[module])) or '-'}")
        print()
    found = problems(g) + core_problems(g=g)
    for p in found:
        print(p)
    print(f"{len(g)} modules, {sum(map(len, g.values()))} imports, {len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
