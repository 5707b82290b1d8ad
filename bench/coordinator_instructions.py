"""Instructions per transaction of the coordinator's own work, counted by callgrind.

Why beside `coordinator_overhead.py`: wall and CPU time on a shared two-core machine move by
tens of per cent from run to run, so a CPU saving cannot be shown with them. An instruction count
of the same program on the same input is repeatable to a fraction of a per cent whatever else the
machine does. Each configuration runs twice under ``valgrind --tool=callgrind`` (200 and 1,200
transactions of two no-op branches, 60 s timeout, completion on the caller's thread); the
difference divided by 1,000 cancels the interpreter's start-up.

    python bench/coordinator_instructions.py [--json PATH]

Figures of this change (issue 13), on this machine: memory log 314,813 -> 274,515; file log
416,451 -> 374,166 instructions per transaction. With OpenTelemetry's SDK installed, a third row
runs the memory log's transactions traced (`messaging.tracing`, every span recorded then
dropped): what tracing costs when it is on.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = (200, 1200)

CHILD = """
import sys, tempfile
from pathlib import Path
sys.path.insert(0, {root!r}); sys.path.insert(0, {bench!r})
from coordinator_overhead import NoOpResource
from coordinator import FileDecisionLog, MemoryDecisionLog, TransactionManager
kind, n = sys.argv[1], int(sys.argv[2])
if kind == "traced":  # OpenTelemetry's SDK: every span made and recorded, then dropped
    from opentelemetry.sdk.trace import TracerProvider
    from messaging.tracing import instrument
    instrument(TracerProvider())
log = FileDecisionLog(Path(tempfile.mkdtemp()) / "log") if kind == "file" else MemoryDecisionLog()
tm = TransactionManager("b", log, recovery_interval=None, reaper_interval=None)
a, b = NoOpResource("a"), NoOpResource("b")
for _ in range(n):
    with tm.transaction(60.0) as tx:
        tx.join(a)
        tx.join(b)
tm.close()
"""


def instructions(script: Path, *args: object) -> int:
    """Instructions callgrind counts for one run of ``script`` with ``args`` (also used by
    `producer_instructions.py`)."""
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
         sys.executable, str(script), *map(str, args)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = re.search(r"Collected\s*:\s*(\d+)", out.stderr)
    if found is None:
        raise SystemExit(f"no instruction count in valgrind's output:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "child.py"
        script.write_text(CHILD.format(root=str(ROOT), bench=str(ROOT / "bench")))
        kinds = ["memory", "file"]
        if importlib.util.find_spec("opentelemetry.sdk") is not None:
            kinds.append("traced")  # the memory log's row, traced (`messaging.tracing`)
        for kind in kinds:
            low, high = (instructions(script, kind, n) for n in RUNS)
            per_tx = (high - low) // (RUNS[1] - RUNS[0])
            rows.append({"row": f"{kind} log", "instructions_per_tx": per_tx})
            label = "memory log, traced" if kind == "traced" else f"{kind} log"
            rows[-1]["row"] = label
            print(f"{label:<19} {per_tx:>10,} instructions per transaction")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
