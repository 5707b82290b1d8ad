"""The examples of docs/messaging.md, README.md, docs/postgres.md, docs/concepts.md,
docs/redis.md and docs/scale.md run.

A block is an example when the line right before its ```` ```python ```` fence is
``<!-- example: NAME -->``. Each runs as a script of its own in a fresh interpreter (cwd a
temporary directory, the repository on ``PYTHONPATH``), so a block cannot lean on another's
state or on anything this test imports; an example that needs PostgreSQL reads its URL from
``TWOPC_EXAMPLE_PG_URL``, a fresh database of the shared test server, and one that needs Redis
``TWOPC_EXAMPLE_REDIS_URL``, the shared test Redis, flushed. Sections that document a
mechanism must carry at least one example: a section whose example was dropped fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from coordinator.crashpoints import ENV_VAR

pytestmark = pytest.mark.timeout(90)

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "messaging.md"
README = REPO / "README.md"
PG_ENV = "TWOPC_EXAMPLE_PG_URL"
REDIS_ENV = "TWOPC_EXAMPLE_REDIS_URL"
TIMEOUT = 60.0

#: the sections (``## `` headings of docs/messaging.md) that must each carry an example
SECTIONS_WITH_EXAMPLES = (
    "Acknowledgment modes and sessions",
    "Producers",
    "Topics and durable subscriptions",
    "Ordered concurrent dispatch",
    "Duplicate elimination in recovery",
    "Distribution lists, non-transactional queues, dead letters and NACKs",
)

_MARK = re.compile(r"^<!-- example: ([A-Za-z0-9_.-]+) -->\n```python\n(.*?)^```$", re.M | re.S)
_HEADING = re.compile(r"^## (.+)$", re.M)


@dataclass(frozen=True)
class Example:
    name: str
    section: str
    code: str


def examples(text: str) -> list[Example]:
    """Every marked block, with the ``## `` section it sits in."""
    headings = [(m.start(), m.group(1).strip()) for m in _HEADING.finditer(text)]
    found = []
    for m in _MARK.finditer(text):
        section = next((h for at, h in reversed(headings) if at < m.start()), "")
        found.append(Example(m.group(1), section, m.group(2)))
    return found


#: the other pages whose marked blocks run too (their sections need not each carry one)
OTHER_PAGES = (
    REPO / "docs" / "postgres.md",
    REPO / "docs" / "concepts.md",
    REPO / "docs" / "redis.md",
    REPO / "docs" / "scale.md",
)
EXAMPLES = [
    *examples(DOC.read_text(encoding="utf-8")),
    *examples(README.read_text(encoding="utf-8")),
    *(e for page in OTHER_PAGES for e in examples(page.read_text(encoding="utf-8"))),
]


def test_every_documented_mechanism_has_a_runnable_example() -> None:
    names = [e.name for e in EXAMPLES]
    assert len(names) == len(set(names)), f"duplicate example names: {names}"
    texts = [p.read_text(encoding="utf-8") for p in (DOC, README, *OTHER_PAGES)]
    marks = [m for t in texts for m in re.findall(r"^<!-- example:.*$", t, re.M)]
    assert len(marks) == len(EXAMPLES), f"a marker not right before a ```python fence: {marks}"
    covered = {e.section for e in EXAMPLES}
    missing = [s for s in SECTIONS_WITH_EXAMPLES if s not in covered]
    assert not missing, f"sections of {DOC.name} without a marked example: {missing}"


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_example_runs(example: Example, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    script = tmp_path / f"{example.name}.py"
    script.write_text(example.code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(ENV_VAR, None)  # an armed crash point would kill the example, not test it
    if PG_ENV in example.code:
        env[PG_ENV] = request.getfixturevalue("make_pg_database")()
    if REDIS_ENV in example.code:
        env[REDIS_ENV] = request.getfixturevalue("redis_url")
    try:
        done = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
            text=True, timeout=TIMEOUT,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr or b""  # bytes even with text=True
        text = err.decode(errors="replace") if isinstance(err, bytes) else err
        pytest.fail(f"example {example.name!r} ran over {TIMEOUT:.0f} s:\n{text}")
    assert done.returncode == 0, (
        f"example {example.name!r} ({example.section}) exited {done.returncode}:\n"
        f"{done.stderr}\n--- stdout ---\n{done.stdout[-2000:]}"
    )
