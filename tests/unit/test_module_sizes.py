"""No library module is over ~400 lines unless its module docstring says why (STYLE.md, point 9:
a module past ~400 lines is asking to be split).

The marker is a sentence in the module docstring that begins ``Why one module:`` and gives the
reason, e.g. "Why one module: the completion protocol is kept in one module so that a reviewer
reads every path to the decision in one place." A long module without it fails here: split it by
concern, or say why it stays whole.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("coordinator", "resource_managers", "messaging", "spark_integration", "twopc_demo")
LIMIT = 400
MARKER = "Why one module:"

#: long modules neither split nor explained yet: none (an entry here must name a module over the
#: limit without its reason; `test_allowlist_is_not_stale` fails on one that no longer needs it)
ALLOWED: frozenset[str] = frozenset()


def _library_modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _explained(path: Path) -> bool:
    docstring = ast.get_docstring(ast.parse(path.read_text()), clean=True) or ""
    reason = docstring.partition(MARKER)[2].strip()
    return len(reason) > 20  # the marker followed by an actual sentence


def test_long_modules_say_why() -> None:
    unexplained = [
        f"{path.relative_to(ROOT)} ({_lines(path)} lines)"
        for path in _library_modules()
        if _lines(path) > LIMIT
        and not _explained(path)
        and path.relative_to(ROOT).as_posix() not in ALLOWED
    ]
    assert unexplained == [], (
        f"modules over {LIMIT} lines whose docstring has no {MARKER!r} sentence: split them by "
        "concern, or say why they stay whole"
    )


def test_allowlist_is_not_stale() -> None:
    """An allowed module that is gone or explained no longer needs its entry."""
    stale = [
        name for name in sorted(ALLOWED) if not (ROOT / name).exists() or _explained(ROOT / name)
    ]
    assert stale == [], f"remove from ALLOWED: {stale}"


def test_the_marker_is_found() -> None:
    """The check itself: a module this test knows to be long and explained passes it."""
    completion = ROOT / "coordinator" / "_completion.py"
    assert _lines(completion) > LIMIT
    assert _explained(completion)
