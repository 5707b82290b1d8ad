"""The process the PostgreSQL crash tests kill: transactions, recovery or a bank over databases.

    python tests/crash/pg_worker.py run     --db a=URL --db b=URL [--db c=URL] --log LOG --plan P
    python tests/crash/pg_worker.py recover --db a=URL --db b=URL [--db c=URL] --log LOG
    python tests/crash/pg_worker.py bank    --db a=URL --db b=URL --log LOG --threads 4 --seed S
    python tests/crash/pg_worker.py serve   (a fork server: one request per line on stdin)

Each ``--db name=URL`` is one `PostgresResource` named ``name`` (its crash point is
``postgres.<name>.after_prepare``); ``--last NAME`` makes that one a logging last resource.
``--log`` is ``file:DIR`` (a `FileDecisionLog`) or ``sql:URL`` (a `SqlDecisionLog` under the
same node id; ``--lease-seconds``, ``--acquire-timeout``). Every database holds the schema of
`SCHEMA`: ``accounts`` and one ``transfers`` row per branch that wrote, keyed by the gtrid, so
a test can tell per transaction which databases it reached. Printed (flushed, so a SIGKILL loses
nothing printed), as worker.py::

    BEGIN <gtrid> <kind> <resources that wrote>    before commit is called
    STOPPED <point>                                --stop-at POINT[:NTH]: then it SIGSTOPs itself
    ACK <gtrid> <outcome>                          commit returned: the caller was told
    ABORTED <gtrid> <code> <cause's code, or ->    commit raised TransactionRolledBack
    UNKNOWN <gtrid> <code>                         commit raised another TransactionError
    DONE                                           the plan ran out without a crash

``run`` kinds (as worker.py): ``2pc`` moves one unit from ``--account`` of a to the same account
of b and writes a ledger row in c when there is a c; ``veto``: the same, but c's insert breaks
NOT NULL so c votes no; ``1pc``: a ledger row in a alone; ``ro``: a -> b while c only reads;
``rob``: ledger rows in a and c while b only reads.

``bank``: ``--threads`` clients move random amounts between random accounts of a and b (each
transfer debits one database and credits the other) until killed; ``recover_on_start`` runs
first, as a restarted service would. ``recover`` runs one ``tm.recover(force=True)`` and prints
``RECOVERED <json>``. Crashes come from ``TWOPC_CRASH_AT`` (`coordinator.crashpoints`).

``serve`` exists for speed: importing SQLAlchemy costs half a second, more than a scenario's
work. It imports everything once, then for each JSON request ``{"argv", "crash_at", "stdout",
"stderr"}`` forks a child that arms ``crash_at``, runs ``main(argv)`` with its output in those
files and exits (or is killed at its point); the server answers ``{"returncode": ...}`` as
`subprocess` would (-9 for SIGKILL). Each child is a new process, killed by a real SIGKILL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: find tests/

from sqlalchemy import create_engine, make_url, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from coordinator import (
    FileDecisionLog,
    TransactionError,
    TransactionManager,
    TransactionRolledBack,
    crashpoints,
)
from coordinator.decision_log import DecisionLog
from coordinator.transaction import Transaction
from resource_managers.postgres import PostgresResource, SqlDecisionLog

NODE_ID = "pg-crash-node"
KINDS = ("2pc", "veto", "1pc", "ro", "rob")

SCHEMA = (
    "CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)",
    # one row per branch that wrote: the gtrid, and the signed amount it moved (0 for a ledger row)
    "CREATE TABLE transfers (id text PRIMARY KEY, account int, amount bigint NOT NULL)",
)

_print_lock = threading.Lock()


def say(*words: object) -> None:
    line = " ".join(str(w) for w in words) + "\n"
    with _print_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


# -- the manager -------------------------------------------------------------------------------


def open_log(spec: str, node_id: str, args: argparse.Namespace) -> DecisionLog:
    kind, _, where = spec.partition(":")
    if kind == "file":
        if args.segment_bytes is None:
            return FileDecisionLog(Path(where))
        return FileDecisionLog(Path(where), segment_bytes=args.segment_bytes)
    if kind == "sql":
        return SqlDecisionLog(
            create_engine(where, pool_pre_ping=True),
            node_id,
            lease_seconds=args.lease_seconds,
            acquire_timeout=args.acquire_timeout,
        )
    raise SystemExit(f"--log must be file:DIR or sql:URL, not {spec!r}")


def open_resources(
    dbs: dict[str, str], pool_size: int, last: str | None = None, driver: str = "psycopg2"
) -> list[PostgresResource]:
    resources = []
    for name, url in dbs.items():
        # a lock held by a crashed run's prepared branch must fail a statement, never hang it
        engine = create_engine(
            make_url(url).set(drivername=f"postgresql+{driver}"),
            pool_size=pool_size,
            connect_args={"options": "-c lock_timeout=5000"},
        )
        resources.append(PostgresResource(engine, name, last_resource=name == last))
    return resources


def open_manager(args: argparse.Namespace, *, recover_on_start: bool) -> TransactionManager:
    resources = open_resources(args.db, args.threads + 2, args.last, args.driver)
    return TransactionManager(
        args.node,
        open_log(args.log, args.node, args),
        resources,
        recovery_interval=None,
        reaper_interval=None,
        recover_on_start=recover_on_start,
        async_phase_two=args.async_phase_two,
    )


def stop_at(spec: str) -> None:
    """At the nth hit of crash point ``name`` (``spec`` is ``name[:nth]``), say STOPPED and stop
    this process with SIGSTOP, to run on when someone sends SIGCONT.

    SIGSTOP freezes every thread at once, the SQL log's lease renewer too, as a long GC pause or
    a frozen VM would. Stopping itself at a named step, not being stopped by a test at a guessed
    moment, leaves the test no race to lose.
    """
    ((name, nth),) = crashpoints.parse(spec).items()
    hits = 0

    def observer(point: str) -> None:
        nonlocal hits
        if point == name:
            hits += 1
            if hits == nth:
                say("STOPPED", point)
                # To this thread, not the process: a process-directed signal may be taken by
                # another thread, and this one would run on (and commit a branch, say) until
                # that thread stopped the group. The stop still freezes every thread.
                signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)

    crashpoints.observe(observer)


# -- the work ----------------------------------------------------------------------------------


def move(session: Session, gtrid: str, account: int | None, amount: int) -> None:
    """``amount`` into ``account`` (none: a ledger row only), and the transfer row that says so."""
    if account is not None:
        session.execute(
            text("UPDATE accounts SET balance = balance + :amount WHERE id = :account"),
            {"amount": amount, "account": account},
        )
    session.execute(
        text("INSERT INTO transfers (id, account, amount) VALUES (:id, :account, :amount)"),
        {"id": gtrid, "account": account, "amount": amount},
    )


def work(
    tm: TransactionManager, tx: Transaction, kind: str, account: int, ledger: bool
) -> list[str]:
    """Do ``kind``'s writes in ``tx`` (``ledger``: there is a c); returns who wrote."""
    a = tx.join(tm.resource("a"))
    if kind == "1pc":
        move(a, tx.gtrid, None, 0)
        return ["a"]
    b = tx.join(tm.resource("b"))
    if kind == "rob":
        move(a, tx.gtrid, None, 0)
        b.execute(text("SELECT count(*) FROM transfers"))
        move(tx.join(tm.resource("c")), tx.gtrid, None, 1)
        return ["a", "c"]
    move(a, tx.gtrid, account, -1)
    move(b, tx.gtrid, account, 1)
    if not ledger:
        return ["a", "b"]
    c = tx.join(tm.resource("c"))
    if kind == "ro":
        c.execute(text("SELECT count(*) FROM transfers"))
        return ["a", "b"]
    if kind == "veto":
        with contextlib.suppress(DBAPIError):  # NOT NULL: the branch is doomed, votes no
            c.execute(text("INSERT INTO transfers (id, amount) VALUES (:id, NULL)"), {"id": "x"})
    else:
        move(c, tx.gtrid, None, 0)
    return ["a", "b", "c"]


def finish(tx: Transaction) -> None:
    """Commit and print how it ended."""
    try:
        outcome = tx.commit()
    except TransactionRolledBack as exc:
        cause = exc.__cause__
        why = "-" if cause is None else getattr(cause, "code", type(cause).__name__)
        say("ABORTED", tx.gtrid, exc.code, why)
    except TransactionError as exc:
        say("UNKNOWN", tx.gtrid, exc.code)
    else:
        say("ACK", tx.gtrid, outcome.value)


def run(args: argparse.Namespace, plan: list[str]) -> int:
    tm = open_manager(args, recover_on_start=True)
    for kind in plan:
        tx = tm.begin()
        wrote = work(tm, tx, kind, args.account, "c" in args.db)
        say("BEGIN", tx.gtrid, kind, ",".join(wrote))
        finish(tx)
    say("DONE")
    tm.close()
    return 0


def recover(args: argparse.Namespace) -> int:
    tm = open_manager(args, recover_on_start=False)
    started = time.perf_counter()
    report = tm.recover(force=True)
    elapsed_ms = (time.perf_counter() - started) * 1000
    result = {
        "committed": report.committed,
        "rolled_back": report.rolled_back,
        "heuristics": report.heuristics,
        "failures": report.failures,
        "left_alone": report.left_alone,
        "pending_after": [d.gtrid for d in tm.log.pending()],
        "heuristic_records": [f"{h.gtrid}/{h.branch}" for h in tm.log.heuristics()],
        "recovery_ms": round(elapsed_ms, 2),
        "epoch": tm.log.stats().extra.get("epoch"),  # the SQL log's lease epoch
    }
    tm.close()
    say("RECOVERED", json.dumps(result))
    return 0


# -- the bank ----------------------------------------------------------------------------------


def transfer(tm: TransactionManager, rng: random.Random, accounts: int) -> None:
    """One random transfer between a and b. Branches are joined and written in the same order
    (a, then b) whichever way the money goes, so two transfers never wait on each other across
    databases, where no server could see the deadlock."""
    source = rng.choice("ab")
    amount = rng.randint(1, 20)
    tx = tm.begin()
    try:
        for name in ("a", "b"):
            delta = -amount if name == source else amount
            move(tx.join(tm.resource(name)), tx.gtrid, rng.randrange(accounts), delta)
    except Exception as exc:  # a lock timeout, say: the transfer never happened
        tx.rollback()
        say("ABORTED", tx.gtrid, type(exc).__name__)
        return
    say("BEGIN", tx.gtrid, "2pc", "a,b")
    finish(tx)


def bank(args: argparse.Namespace) -> int:
    tm = open_manager(args, recover_on_start=True)
    return run_clients(tm, args, lambda rng: transfer(tm, rng, args.accounts))


def run_clients(
    tm: TransactionManager, args: argparse.Namespace, one: Callable[[random.Random], None]
) -> int:
    """``args.threads`` clients each running ``one`` until ``args.duration`` is up (or a kill)."""
    say("READY")
    stop = threading.Event()

    def client(index: int) -> None:
        rng = random.Random(f"{args.seed}-{index}")
        while not stop.is_set():
            one(rng)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.threads)]
    for thread in threads:
        thread.start()
    stop.wait(args.duration)
    stop.set()
    for thread in threads:
        thread.join()
    say("DONE")
    tm.close()
    return 0


# -- the fork server ---------------------------------------------------------------------------


def serve(entry: Callable[[list[str]], int] | None = None) -> int:
    """Fork one child per request line, wait for it, answer its return code.

    ``entry`` is the worker's ``main`` (this module's by default; redis_worker.py passes its own).
    """
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(request, entry or main)
        _, status = os.waitpid(pid, 0)
        say(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}))
    return 0


def child(request: dict[str, Any], entry: Callable[[list[str]], int]) -> None:
    """Run one request in this forked process and exit; never returns."""
    code = 1
    try:
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(out, fd)
            os.close(out)
        sys.stdin = open(os.devnull)  # noqa: SIM115  the server's requests are not ours
        crashpoints.arm(request.get("crash_at") or "")
        code = entry(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


# -- the command line --------------------------------------------------------------------------


def database(spec: str) -> tuple[str, str]:
    name, sep, url = spec.partition("=")
    if not sep or not name or not url:
        raise argparse.ArgumentTypeError(f"expected name=URL, not {spec!r}")
    return name, url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("run", "recover", "bank", "serve"))
    parser.add_argument("--db", type=database, action="append", default=[])
    parser.add_argument("--last", default=None, help="the --db that is a logging last resource")
    parser.add_argument(
        "--async-phase-two", action="store_true", help="phase two on a background worker"
    )
    parser.add_argument("--driver", default="psycopg2", choices=("psycopg2", "psycopg"))
    parser.add_argument("--log", default="", help="file:DIR or sql:URL")
    parser.add_argument("--node", default=NODE_ID)
    parser.add_argument("--plan", default="2pc,2pc,2pc")
    parser.add_argument("--account", type=int, default=1)
    parser.add_argument("--segment-bytes", type=int, default=None)
    parser.add_argument("--lease-seconds", type=float, default=30.0)
    parser.add_argument("--acquire-timeout", type=float, default=0.0)
    parser.add_argument("--stop-at", default="", metavar="POINT[:NTH]")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--accounts", type=int, default=8)
    parser.add_argument("--seed", default="0")
    parser.add_argument("--duration", type=float, default=3600.0)
    args = parser.parse_args(argv)
    if args.mode == "serve":
        return serve()
    if not args.db or not args.log:
        parser.error("--db and --log are required")
    args.db = dict(args.db)
    if args.stop_at:
        stop_at(args.stop_at)
    if args.mode == "recover":
        return recover(args)
    if args.mode == "bank":
        return bank(args)
    plan = args.plan.split(",")
    unknown = set(plan) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}; expected some of {KINDS}")
    return run(args, plan)


if __name__ == "__main__":
    sys.exit(main())
