"""CPU per message of each thread of `bench/messaging.py`'s twopc rows, and of the whole machine.

Issue 14 asks why `twopc-eo` is slower than the outbox. On two cores, with every process busy, a
row's rate is its total CPU per message; this splits that CPU by thread, so a change can be judged
by the thread it was meant to spare. Each row runs ``bench/messaging.py``'s own producer and
consumer processes (`run_twopc`); a sampling thread in each reads every thread's CPU time (user +
system, ``/proc/self/task``) and voluntary context switches ten times a second, and the last sample
before the process ends is reported, divided by the messages. ``machine`` is ``/proc/stat``'s busy
time over the row (PostgreSQL and the kernel's share included; anything else running counts too);
``postgres`` the throwaway cluster's processes alone (the postmaster, its children, and what the
children that ended left in the postmaster's account).

    python bench/messaging_threads.py [--modes exactly-once] [--per-tx 1,10] [--messages 2000]
        [--json PATH]

Thread names: the application's ``MainThread``; the producer's ``twopc-transfer-pump`` (sends,
acknowledgments) and ``twopc-lazy-message log ...`` (the log's lazy records' fsync); the
consumer's ``twopc-conn-<port>`` (the transfer's receiver), ``twopc-transfer-acks`` and
``twopc-lazy-cursor ...``. Wall time on a shared machine is noisy: compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from messaging_counts import bm  # type: ignore[import-not-found]  # bench/messaging.py

TICKS = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 0.1


def _thread_times() -> dict[str, tuple[str, float, int]]:
    """Every thread of this process: native id -> (name, CPU seconds, voluntary switches)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, tuple[str, float, int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            status = Path(f"/proc/self/task/{tid}/status").read_text()
        except OSError:  # it ended meanwhile
            continue
        switches = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        name = names.get(int(tid), "?")
        out[tid] = (name, (int(stat[11]) + int(stat[12])) / TICKS, switches)
    return out


def _sampled(target: Any, out: Path) -> Any:
    """``target`` run with a daemon thread writing `_thread_times` to ``out`` every 0.1 s."""

    def run(*args: Any) -> None:
        def sample() -> None:
            seen: dict[str, tuple[str, float, int]] = {}
            while True:
                for tid, (name, cpu, switches) in _thread_times().items():
                    known = seen[tid][0] if name == "?" and tid in seen else name  # named once
                    seen[tid] = (known, cpu, switches)
                out.write_text(json.dumps(seen))
                time.sleep(SAMPLE_S)

        threading.Thread(target=sample, daemon=True, name="bench-sampler").start()
        target(*args)

    return run


def _machine_busy() -> tuple[int, int]:
    """``/proc/stat``'s busy and total ticks (busy: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def _postgres_cpu(dsn: str) -> float:
    """CPU seconds of the cluster behind ``dsn`` so far: its postmaster (found through the data
    directory's ``postmaster.pid``) with the children it reaped, and its live children."""
    import psycopg2

    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT setting FROM pg_settings WHERE name = 'data_directory'")
        [(datadir,)] = cur.fetchall()
    conn.close()
    postmaster = int((Path(datadir) / "postmaster.pid").read_text().split()[0])
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(pid) == postmaster:
            total += sum(int(f) for f in fields[11:15])  # its own and its reaped children's
        elif int(fields[1]) == postmaster:
            total += int(fields[11]) + int(fields[12])
    return total / TICKS


def _side(path: Path, messages: int) -> dict[str, Any]:
    threads: dict[str, list[float]] = {}
    for raw, cpu, switches in json.loads(path.read_text()).values():
        if raw == "bench-sampler":
            continue
        name = re.sub(r" /\S+", "", raw)  # a store's directory: a fresh temporary path per row
        total = threads.setdefault(name, [0.0, 0.0])
        total[0] += cpu * 1e6 / messages
        total[1] += switches / messages
    return {
        "us_per_msg": round(sum(t[0] for t in threads.values())),
        "threads": {n: {"us_per_msg": round(t[0]), "vcsw_per_msg": round(t[1], 1)}
                    for n, t in sorted(threads.items(), key=lambda kv: -kv[1][0])},
    }  # fmt: skip


def run_row(mode: str, dsns: tuple[str, str], per_tx: int, messages: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        files = {side: Path(tmp) / f"{side}.json" for side in ("producer", "consumer")}
        producer, consumer = bm.producer_main, bm.consumer_main
        bm.producer_main = _sampled(producer, files["producer"])
        bm.consumer_main = _sampled(consumer, files["consumer"])
        try:
            before, pg_before = _machine_busy(), _postgres_cpu(dsns[0])
            result = bm.run_twopc(mode, dsns, per_tx, messages)
            after, pg_after = _machine_busy(), _postgres_cpu(dsns[0])
        finally:
            bm.producer_main, bm.consumer_main = producer, consumer
        busy, total = after[0] - before[0], after[1] - before[1]
        return {
            "mode": mode,
            "per_tx": per_tx,
            "msg_s": round(result.msgs_per_s),
            "p50_ms": round(result.p50_ms, 3),
            "machine_us_per_msg": round(busy / TICKS * 1e6 / messages),
            "machine_idle": round(1 - busy / total, 2) if total else 0.0,
            "postgres_us_per_msg": round((pg_after - pg_before) * 1e6 / messages),
            **{side: _side(path, messages) for side, path in files.items()},
        }


def print_row(row: dict[str, Any]) -> None:
    print(f"{row['mode']} at {row['per_tx']}/tx: {row['msg_s']:,} msg/s, p50 {row['p50_ms']} ms; "
          f"machine {row['machine_us_per_msg']} us/msg busy, idle {row['machine_idle']:.0%}; "
          f"postgres {row['postgres_us_per_msg']} us/msg")  # fmt: skip
    for side in ("producer", "consumer"):
        print(f"  {side:<9} {row[side]['us_per_msg']:>6} us/msg")
        for name, t in row[side]["threads"].items():
            print(f"    {name:<28} {t['us_per_msg']:>6} us/msg {t['vcsw_per_msg']:>6} vcsw/msg")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--modes", default="exactly-once",
                        help=f"a comma-separated subset of {','.join(bm.MODES)}")  # fmt: skip
    parser.add_argument("--per-tx", default="1,10", help="batch sizes (1,10)")
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(bm.MODES) | {"exactly-once-aio"} & set(modes))
    if unknown or not modes:
        parser.error(f"--modes: unknown or unsupported {unknown}; known: {','.join(bm.MODES)} "
                     "(not exactly-once-aio: its processes are another module's)")  # fmt: skip
    rows = []
    with bm.databases(None, None) as dsns:
        for per_tx in (int(n) for n in args.per_tx.split(",")):
            for mode in modes:
                rows.append(run_row(mode, dsns, per_tx, args.messages))
                print_row(rows[-1])
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
