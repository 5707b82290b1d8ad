"""What a large producer branch costs against a served message log, outside Spark: the client in
this process, the log (`Listener` + `ProducerService`) in a child process, so each side's CPU is
its own.

``--rows`` messages (the Spark bench's ``{id},{name},{amount}`` bodies) go in ``--branches``
branches, one after another: start, send (``send_many`` per 1,000 rows, or ``send`` per row with
``--per-row``), prepare, commit. Prints microseconds per row, the client's and the server's CPU
seconds, and the time in send, prepare and commit; ``--json PATH`` writes them. This is the
measurement behind the message-log changes of 28 November 2026 in ``docs/spark.md`` (packed
messages, ``send_many``): run it on two checkouts and compare.

    python bench/mlog_remote_branch.py [--rows 250000] [--branches 1] [--per-row] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.xid import Xid
from messaging.auth import SharedSecret
from messaging.connection import Listener
from messaging.remote import PRODUCER_ROLE, ProducerService, RemoteMessageLog
from resource_managers.message_log import MessageLog

SECRET = b"mlog remote branch bench secret!"
CHUNK = 1_000


def _cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def serve(directory: str, ready: Any, done: Any) -> None:
    """The log's side: serve until SIGTERM, then report this process's CPU seconds."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    mlog = MessageLog(Path(directory))
    listener = Listener(("127.0.0.1", 0), SharedSecret(SECRET), "bench-log",
                        {PRODUCER_ROLE: ProducerService(mlog)}).start()  # fmt: skip
    ready.put(listener.address)
    stop.wait()
    done.put(_cpu())
    listener.close()
    mlog.close()


def produce(address: tuple[str, int], rows: int, branches: int, per_row: bool) -> dict[str, float]:
    """The client's side: every branch's send, prepare and commit, timed."""
    spent = {"send": 0.0, "prepare": 0.0, "commit": 0.0}
    per = rows // branches
    with RemoteMessageLog(address, SharedSecret(SECRET), name="mlog") as remote:
        for k in range(branches):
            xid = Xid.branch_of(f"bench:{k}", "mlog")
            started = time.perf_counter()
            branch = remote.start(xid)
            for first in range(k * per, (k + 1) * per, CHUNK):
                bodies = [f"{i},name-{i},{i % 1000}".encode()
                          for i in range(first, min(first + CHUNK, (k + 1) * per))]  # fmt: skip
                if per_row:
                    for body in bodies:
                        branch.send("items", body)
                else:
                    branch.send_many("items", bodies)
            sent = time.perf_counter()
            remote.prepare(xid)
            prepared = time.perf_counter()
            remote.commit(xid)
            remote.flush_commits()
            spent["send"] += sent - started
            spent["prepare"] += prepared - sent
            spent["commit"] += time.perf_counter() - prepared
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=250_000)
    parser.add_argument("--branches", type=int, default=1)
    parser.add_argument("--per-row", action="store_true", help="send per row, not send_many")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.rows < args.branches or args.branches < 1:
        parser.error("--rows must be at least --branches, which must be at least 1")
    directory = tempfile.mkdtemp(prefix="twopc-mlog-branch-")
    ctx = mp.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=serve, args=(directory, ready, done))
    server.start()
    try:
        address = ready.get(timeout=60)
        cpu, started = _cpu(), time.perf_counter()
        spent = produce(address, args.rows, args.branches, args.per_row)
        seconds, client_cpu = time.perf_counter() - started, _cpu() - cpu
        server.terminate()
        server_cpu = done.get(timeout=60)
        server.join(60)
    finally:
        if server.is_alive():
            server.kill()
        shutil.rmtree(directory, ignore_errors=True)
    rows = args.rows // args.branches * args.branches
    result = {"rows": rows, "branches": args.branches, "per_row": args.per_row,
              "us_per_row": seconds / rows * 1e6, "seconds": seconds,
              "client_cpu_s": client_cpu, "server_cpu_s": server_cpu,
              **{f"{k}_s": v for k, v in spent.items()}}  # fmt: skip
    print(f"{rows:,} rows in {args.branches} branch(es), "
          f"{'send per row' if args.per_row else 'send_many'}: {result['us_per_row']:.1f} us/row; "
          f"client CPU {client_cpu:.2f} s, server CPU {server_cpu:.2f} s; send "
          f"{spent['send']:.2f} s, prepare {spent['prepare']:.2f} s, commit "
          f"{spent['commit']:.2f} s")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
