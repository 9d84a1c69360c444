"""Check a SGLang release's *source* against the plugin's table for it (`compat.RELEASES`), statically.

A release that cannot be imported here (another torch, no GPU) can still be checked: every hook
target and every internal the hooks read is looked up in the release's files with `ast` — the
module file, the class, the method (sync or `async`), the parameters the hook relies on (present,
in that order), the attributes (a class-body name, a property or a `self.x = ...` assignment, in
the class or a base class of the same module). The result is the list of what does not match, one
line each; empty means every name in the table is in that source.

    python -m aerie_sglang.plugin.source_check 0.5.17 /path/to/unpacked/wheel   # root holding sglang/
"""

from __future__ import annotations

import ast
import sys
from functools import lru_cache
from pathlib import Path

from aerie_sglang.plugin.compat import RELEASES, Hook, Release, Uses

_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _parse(path: Path) -> ast.Module:
    stat = path.stat()
    return _parse_version(path, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=256)
def _parse_version(path: Path, mtime_ns: int, size: int) -> ast.Module:  # a file edited since is parsed again
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _split(root: Path, target: str) -> tuple[Path, list[str]] | None:
    """The module file of the longest importable prefix of `target`, and the names after it."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        base = root.joinpath(*parts[:cut])
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path, parts[cut:]
    return None


def _member(body: list[ast.stmt], name: str) -> ast.AST | None:
    found: ast.AST | None = None
    for node in body:  # the last definition wins, as at import time
        if isinstance(node, (*_FUNCS, ast.ClassDef)) and node.name == name:
            found = node
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            found = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            found = node
    return found


def _self_assigns(cls: ast.ClassDef, name: str) -> bool:
    for node in ast.walk(cls):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for t in targets:
            if (
                isinstance(t, ast.Attribute)
                and t.attr == name
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
            ):
                return True
    return False


def _in_class(
    module: ast.Module, cls: ast.ClassDef, name: str, attr_ok: bool, seen: frozenset = frozenset()
) -> ast.AST | None:
    """`name` defined in `cls` or in a base class defined in the same module."""
    node = _member(cls.body, name)
    if node is not None:
        return node
    if attr_ok and _self_assigns(cls, name):
        return cls
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id not in seen:
            parent = _member(module.body, base.id)
            if isinstance(parent, ast.ClassDef):
                found = _in_class(module, parent, name, attr_ok, seen | {cls.name})
                if found is not None:
                    return found
    return None


def _resolve(root: Path, target: str, attr_ok: bool) -> tuple[ast.AST | None, str]:
    split = _split(root, target)
    if split is None:
        return None, f"{target}: no module file for it under {root}"
    path, names = split
    module = _parse(path)
    node: ast.AST | None = None
    scope: list[ast.stmt] = module.body
    for i, name in enumerate(names):
        if isinstance(node, ast.ClassDef):
            found = _in_class(module, node, name, attr_ok and i == len(names) - 1)
        else:
            found = _member(scope, name)
        if found is None:
            where = ".".join(names[:i]) or path.name
            return None, f"{target}: {name!r} is not defined in {where} ({path.relative_to(root)})"
        node = found
        scope = getattr(found, "body", [])
    return node, ""


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args)]
    names += [a.vararg.arg] if a.vararg else []
    names += [p.arg for p in a.kwonlyargs]
    return names + ([a.kwarg.arg] if a.kwarg else [])


def _check_params(target: str, fn: ast.AST, wanted: tuple[str, ...], is_async: bool | None, leading: bool) -> list[str]:
    """`leading`: the target's first parameters are exactly `wanted` (a hook may read them by
    position); otherwise they only have to exist (they are passed by name)."""
    if not isinstance(fn, _FUNCS):
        return [f"{target}: is not a function ({type(fn).__name__})"]
    problems = []
    if is_async is not None and isinstance(fn, ast.AsyncFunctionDef) != is_async:
        problems.append(
            f"{target}: is {'async ' if isinstance(fn, ast.AsyncFunctionDef) else ''}def, the hook "
            f"expects {'async def' if is_async else 'def'}"
        )
    have = _params(fn)
    missing = [p for p in wanted if p not in have]
    if missing:
        problems.append(f"{target}: has parameters {have}, the plugin needs {missing}")
    elif leading and have[: len(wanted)] != list(wanted):
        problems.append(f"{target}: has parameters {have}, the plugin expects {list(wanted)} first, in that order")
    return problems


def check_hook(root: Path, hook: Hook) -> list[str]:
    node, why = _resolve(root, hook.target, attr_ok=False)
    if node is None:
        return [why]
    return _check_params(hook.target, node, hook.params, hook.is_async, leading=True)


def check_use(root: Path, use: Uses) -> list[str]:
    node, why = _resolve(root, use.target, attr_ok=use.kind == "attr")
    if node is None:
        return [why]
    if use.kind == "call":
        return _check_params(use.target, node, use.params, None, leading=False)
    if use.kind == "fresh_pinned":
        return _check_fresh_pinned(use.target, node)
    if isinstance(node, ast.ClassDef) and not use.target.endswith("." + node.name):
        return []  # a `self.x = ...` assignment in the class
    if isinstance(node, (ast.Assign, ast.AnnAssign, *_FUNCS)):
        return []
    return [f"{use.target}: is a {type(node).__name__}, not an attribute"]


def _check_fresh_pinned(target: str, fn: ast.AST) -> list[str]:
    """The function allocates pinned host memory (a call with `pin_memory=True`) and copies into it
    (a `.copy_(...)` call): new memory at each call, which the plugin keeps views of."""
    if not isinstance(fn, _FUNCS):
        return [f"{target}: is not a function ({type(fn).__name__})"]
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
    pins = any(
        k.arg == "pin_memory" and isinstance(k.value, ast.Constant) and k.value.value is True
        for c in calls
        for k in c.keywords
    )
    copies = any(isinstance(c.func, ast.Attribute) and c.func.attr == "copy_" for c in calls)
    if pins and copies:
        return []
    return [
        f"{target}: does not copy into new pinned memory (pin_memory=True, .copy_) at each call: the plugin "
        "keeps views of the host rows it returns (hooks._own), which a reused buffer would overwrite"
    ]


def check(release: Release, root: str | Path) -> list[str]:
    """Every mismatch between `release`'s table and the SGLang source under `root` (holding `sglang/`)."""
    root = Path(root)
    if not (root / "sglang" / "__init__.py").is_file():
        return [f"{root} holds no sglang package (expected {root}/sglang/__init__.py)"]
    problems: list[str] = []
    for hook in release.hooks:
        problems += check_hook(root, hook)
    for use in release.uses:
        problems += check_use(root, use)
    return problems


def source_version(root: str | Path) -> str | None:
    """The version of the sglang under `root`: its dist-info's METADATA (a wheel, a site-packages)."""
    for meta in sorted(Path(root).glob("sglang-*.dist-info/METADATA")):
        for line in meta.read_text(encoding="utf-8").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
            if not line:
                break
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in RELEASES:
        print(f"usage: python -m aerie_sglang.plugin.source_check {{{','.join(RELEASES)}}} <root holding sglang/>")
        return 2
    found = source_version(argv[1])
    problems = [] if found in (None, argv[0]) else [f"{argv[1]} holds sglang=={found}, not {argv[0]}"]
    problems += check(RELEASES[argv[0]], argv[1])
    for line in problems:
        print(line)
    print(f"sglang=={argv[0]}: {'OK' if not problems else f'{len(problems)} mismatch(es)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
