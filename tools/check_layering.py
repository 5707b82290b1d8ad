"""Fail when an import breaks the layering spark_integration > messaging
> resource_managers > coordinator.

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
LAYERS = ["coordinator", "resource_managers", "messaging", "spark_integration"]


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


def main() -> int:
    problems = violations()
    for line in problems:
        print(line, file=sys.stderr)
    print(f"layering: {len(problems)} violation(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
