"""Fail when an import breaks the layering twopc_demo > spark_integration > messaging
> resource_managers > coordinator, or when modules of any of these packages import each other in
a circle.

Why a script and not a convention: the coordinator is the part people trust with their money, so it
must stay importable with nothing but the standard library, and a lower layer must never reach up
(that is how cycles, and optional dependencies leaking into the core, begin). Every import counts,
including ones inside functions.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["coordinator", "resource_managers", "messaging", "spark_integration", "twopc_demo"]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def violations() -> list[str]:
    stdlib = set(sys.stdlib_module_names)
    problems: list[str] = []
    for rank, package in enumerate(LAYERS):
        allowed_ours = set(LAYERS[: rank + 1])
        for path in sorted((ROOT / package).rglob("*.py")):
            for lineno, module in imported_modules(path):
                top = module.split(".")[0]
                where = f"{path.relative_to(ROOT)}:{lineno}"
                if top in LAYERS and top not in allowed_ours:
                    problems.append(f"{where}: {package} must not import {module} (layer above)")
                elif package == "coordinator" and top not in stdlib and top not in LAYERS:
                    problems.append(f"{where}: coordinator imports third-party {module}")
    return problems


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _local_imports(path: Path, known: set[str]) -> set[str]:
    """Modules of ``known`` that ``path`` imports (relative or absolute, at any depth, including
    imports under ``if TYPE_CHECKING``: a circle of type hints is still a circle of modules)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in known and m != name}


def cycles(package: str = "coordinator") -> list[list[str]]:
    """Import circles among the modules of ``package`` (package ``__init__`` files excluded:
    re-exporting is not depending)."""
    paths = {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}
    known = {m for m, p in paths.items() if p.name != "__init__.py"}
    graph = {m: _local_imports(paths[m], known) for m in known}
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                found.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[module] = 2

    for module in sorted(known):
        if module not in state:
            visit(module)
    return found


def main() -> int:
    problems = violations()
    for package in LAYERS:
        problems += [f"import circle: {' -> '.join(c)}" for c in cycles(package)]
    for line in problems:
        print(line, file=sys.stderr)
    print(f"layering: {len(problems)} violation(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
