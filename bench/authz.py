"""What per-client authorisation costs a remote producer: transactions/s of one-message
transactions through `RemoteMessageLog` to a `LogServer` (with its `CursorServer`, both in this
process on loopback), the shared secret alone against a clients file, side by side; and the
authorisation check of one request on its own, in microseconds.

Why both numbers: the end-to-end rate says whether anyone would notice (a remote transaction is a
round trip, a forced journal record and a transfer); the check alone says what the hot path pays
per request (a dict lookup for the client, a node-id parse, a cached glob answer per destination).
The modes alternate, ``--rounds`` times each, and the median is printed, so a machine busy with
something else skews both the same way.

    python bench/authz.py [--transactions 1500] [--rounds 3] [--messages-per-tx 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator import MemoryDecisionLog, TransactionManager, Xid
from messaging.auth import SharedSecret
from messaging.authz import Authoriser
from messaging.frames import FrameType, XaRequest
from messaging.remote import RemoteMessageLog
from messaging.remote._grants import authorise_producer
from messaging.server import CursorServer, LogServer
from resource_managers.message_log import new_message

SECRET = b"bench shared secret, 32 bytes!!!"
APP = b"bench app secret, 32 bytes long!"
CLIENTS = f"""
[clients.app]
secret = "{APP.decode()}"
produce = ["bench.other.*", "orders.*"]
nodes = ["other-*", "bench"]

[clients.twopc-log]
secret = "{SECRET.decode()}"
transfer = true
"""


def rate(work: Path, clients: Path | None, transactions: int, per_tx: int) -> float:
    """Transactions/s of ``transactions`` one-phase remote commits of ``per_tx`` messages."""
    secret = SharedSecret(SECRET)
    with (
        CursorServer(work / "cursor", secret, listen=("127.0.0.1", 0), clients=clients,
                     clients_watch=0) as cursor,
        LogServer(work / "log", secret, cursor=cursor.address, listen=("127.0.0.1", 0),
                  clients=clients, clients_watch=0) as log,
    ):  # fmt: skip
        assert log.address is not None
        who, key = ("app", APP) if clients is not None else ("twopc-client", SECRET)
        with (
            RemoteMessageLog(log.address, SharedSecret(key), client_id=who) as mlog,
            TransactionManager("bench", MemoryDecisionLog(), [mlog], recovery_interval=None,
                               reaper_interval=None) as tm,
        ):  # fmt: skip
            started = time.perf_counter()
            for n in range(transactions):
                with tm.transaction() as tx:
                    branch = tx.join(mlog)
                    for m in range(per_tx):
                        branch.send("orders.created", b"x" * 256, headers={"n": f"{n}.{m}"})
            elapsed = time.perf_counter() - started
        log.wait_idle(30)
    return transactions / elapsed


def check_cost(work: Path, clients: Path, per_tx: int) -> float:
    """Microseconds `ProducerService` spends authorising one prepare of ``per_tx`` messages."""
    authoriser = Authoriser(clients, watch_interval=0)
    message = new_message(
        "orders.created", body=b"x" * 256, headers={}, persistent=True, ttl=None, now_ms=0
    )
    xid = Xid.branch_of("bench:0a-1", "mlog")
    request = XaRequest(FrameType.XA_PREPARE, 1, xid, {"rm": "mlog", "messages": b""})
    messages = [message] * per_tx  # as the service decodes them, once, before the check

    def check() -> None:  # what the service does per request: the client, its node, its grants
        client = authoriser.client("app")
        authoriser.check_node(client, xid)
        authorise_producer(authoriser, client, request, messages)

    runs = 20000
    took = timeit.timeit(check, number=runs)
    return took / runs * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transactions", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages-per-tx", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        clients = work / "clients.toml"
        clients.write_text(CLIENTS)
        rates: dict[str, list[float]] = {"shared secret": [], "clients file": []}
        for r in range(args.rounds):
            for mode, path in (("shared secret", None), ("clients file", clients)):
                run = work / f"{mode.replace(' ', '-')}-{r}"
                rates[mode].append(rate(run, path, args.transactions, args.messages_per_tx))
        base, authz = (statistics.median(rates[m]) for m in ("shared secret", "clients file"))
        print(f"remote one-phase transactions of {args.messages_per_tx} message(s), "
              f"{args.transactions} per round, median of {args.rounds} rounds:")  # fmt: skip
        for mode, values in rates.items():
            shown = ", ".join(f"{v:.0f}" for v in values)
            print(f"  {mode:14s} {statistics.median(values):8.0f} tx/s   (rounds: {shown})")
        print(f"  clients file / shared secret: {authz / base:.3f}x")
        for per_tx in (1, 100):
            cost = check_cost(work, clients, per_tx)
            print(f"authorising one request of {per_tx} message(s): {cost:.2f} µs")


if __name__ == "__main__":
    main()
