"""The metric families of ``twopc serve log`` and ``twopc serve cursor``, read from the parts'
own counters at the moment of a scrape: nothing is counted here, so serving metrics costs the
message path nothing (see docs/operations.md, "Server metrics", for the table).

The functions take the parts rather than the servers (`messaging.server` calls them), so this
module depends only on what it reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from coordinator.journal import JournalStats
from resource_managers.cursor import Cursor
from resource_managers.message_log import MessageLog

from ..connection import INTERNAL_ERRORS, Address, Listener
from ..topics import TopicDispatcher
from ..transfer import LogTransfer, TransferReceiver
from ._families import Family, counter, gauge


class Swept(Protocol):
    """What the cursor's expiry sweeper exposes (`messaging.expiry.ExpirySweeper`)."""

    @property
    def swept(self) -> int: ...


def journal_families(stats: JournalStats) -> list[Family]:
    return [
        counter("twopc_journal_records", "journal records appended, by durability")
        .add(stats.forced_records, durability="forced")
        .add(stats.lazy_records, durability="lazy"),
        counter("twopc_journal_fsyncs", "journal fsyncs (one per group-committed batch)").add(
            stats.fsyncs
        ),
        counter("twopc_journal_bytes_written", "bytes written to the journal").add(
            stats.bytes_written
        ),
        counter("twopc_journal_rollovers", "journal segments rolled over").add(stats.rollovers),
    ]


def listener_families(listener: Listener | None, service_errors: int) -> list[Family]:
    """Connections; a log server without ``listen`` has none (its families read 0)."""
    s = listener.stats if listener is not None else {}
    return [
        counter("twopc_listener_accepted", "TCP connections accepted").add(s.get("accepted", 0)),
        counter("twopc_listener_authenticated", "connections that passed the handshake").add(
            s.get("authenticated", 0)
        ),
        counter("twopc_listener_refused", "connections refused, by reason")
        .add(s.get("refused_full", 0), reason="full")
        .add(s.get("refused_handshake", 0), reason="handshake"),
        counter("twopc_listener_bad_frames", "connections dropped for a bad frame").add(
            s.get("bad_frames", 0)
        ),
        gauge("twopc_listener_open_connections", "connections open now").add(
            0 if listener is None else listener.open_connections
        ),
        counter("twopc_internal_errors", "defects met while serving (should stay 0)").add(
            s.get(INTERNAL_ERRORS, 0) + service_errors
        ),
    ]


def _peer(address: Address) -> str:
    return f"{address[0]}:{address[1]}"


def transfer_families(transfers: Mapping[Address, LogTransfer]) -> list[Family]:
    """One sample per cursor this log transfers to (label ``cursor``)."""
    out = {
        "sent": counter("twopc_transfer_sent", "MSG frames sent, resends included"),
        "resends": counter("twopc_transfer_resends", "MSG frames sent again (timer or reconnect)"),
        "acked": counter("twopc_transfer_acked", "messages the cursor acknowledged"),
        "expired": counter("twopc_transfer_expired", "messages expired before acknowledgment"),
        "refused": counter("twopc_transfer_refused", "messages the cursor refused (refused/)"),
        "connect_failures": counter("twopc_transfer_connect_failures", "failed connect attempts"),
        "window": gauge("twopc_transfer_window", "messages sent or due, not yet acknowledged"),
        "connected": gauge("twopc_transfer_connected", "1 while connected to the cursor"),
    }
    for address, t in transfers.items():
        cursor, s = _peer(address), t.stats
        out["sent"].add(s["frames_sent"], cursor=cursor)
        out["resends"].add(s["resends"], cursor=cursor)
        out["acked"].add(s["acknowledged"], cursor=cursor)
        out["expired"].add(s["expired"], cursor=cursor)
        out["refused"].add(s["refused"], cursor=cursor)
        out["connect_failures"].add(s["connect_failures"], cursor=cursor)
        out["window"].add(sum(t.backlog().values()), cursor=cursor)
        out["connected"].add(int(t.connected), cursor=cursor)
    return list(out.values())


def log_families(
    mlog: MessageLog,
    transfers: Mapping[Address, LogTransfer],
    listener: Listener | None,
    service_errors: int,
) -> list[Family]:
    """Everything ``twopc serve log`` exports."""
    stats = mlog.stats()
    pending = gauge("twopc_log_pending", "committed messages not yet acknowledged, per stream")
    for stream, n in sorted(mlog.pending_counts().items()):
        pending.add(n, stream=stream)
    return [
        *journal_families(mlog.journal_stats()),
        *listener_families(listener, service_errors),
        *transfer_families(transfers),
        pending,
        gauge("twopc_log_prepared", "prepared producer branches").add(stats.prepared),
        gauge("twopc_log_streams", "streams the log holds").add(stats.streams),
        gauge(
            "twopc_log_refusing_writes",
            "1 once a write failed after its records were applied: restart the server",
        ).add(int(stats.refusing_writes)),
    ]


def queue_families(cursor: Cursor) -> list[Family]:
    """Per queue (label ``queue``): waiting, handed out or prepared, dead letters."""
    available = gauge("twopc_queue_available", "messages waiting in a queue")
    in_flight = gauge("twopc_queue_in_flight", "messages handed out or prepared, per queue")
    dead = gauge("twopc_queue_dead_letters", "messages in a queue's dead-letter queue")
    for q in cursor.queues():
        available.add(q.available, queue=q.queue)
        in_flight.add(q.in_flight, queue=q.queue)
        dead.add(q.dead_letters, queue=q.queue)
    return [available, in_flight, dead]


def subscription_families(cursor: Cursor) -> list[Family]:
    """Per subscription (labels ``topic``, ``subscription``)."""
    connected = gauge("twopc_subscription_connected", "1 while a subscriber is attached")
    available = gauge("twopc_subscription_available", "copies waiting for the subscriber")
    in_flight = gauge("twopc_subscription_in_flight", "copies handed out or prepared")
    for s in sorted(cursor.subscriptions(), key=lambda s: (s.topic, s.name)):
        connected.add(int(s.connected), topic=s.topic, subscription=s.name)
        available.add(s.available, topic=s.topic, subscription=s.name)
        in_flight.add(s.in_flight, topic=s.topic, subscription=s.name)
    return [connected, available, in_flight]


def dispatch_families(cursor: Cursor, topics: TopicDispatcher | None) -> list[Family]:
    s = topics.stats if topics is not None else None
    return [
        counter(
            "twopc_dispatch_copies", "copies the topic dispatcher put in subscription queues"
        ).add(0 if s is None else s.copies + s.recovered),
        counter("twopc_dispatch_finished", "publications fanned out completely").add(
            0 if s is None else s.finished
        ),
        counter(
            "twopc_dispatch_failures", "dispatcher fail-stops (a copy could not be written)"
        ).add(0 if s is None else s.dispatch_failures),
        gauge("twopc_dispatch_backlog", "publications not yet taken by the dispatcher").add(
            cursor.topic_backlog()
        ),
        gauge("twopc_dispatch_in_doubt", "publications taken, not yet fanned out").add(
            len(cursor.in_doubt())
        ),
    ]


def cursor_families(
    cursor: Cursor,
    receiver: TransferReceiver,
    listener: Listener,
    service_errors: int,
    *,
    topics: TopicDispatcher | None,
    sweeper: Swept | None,
) -> list[Family]:
    """Everything ``twopc serve cursor`` exports."""
    r = receiver.stats
    stats = cursor.stats()
    return [
        *journal_families(cursor.journal_stats()),
        *listener_families(listener, service_errors),
        counter("twopc_receiver_messages", "MSG frames judged (duplicates included)").add(
            r["messages"]
        ),
        counter("twopc_receiver_refused", "MSG frames refused with NACK invalid-message").add(
            r["refused"]
        ),
        *queue_families(cursor),
        *subscription_families(cursor),
        *dispatch_families(cursor, topics),
        gauge("twopc_cursor_prepared", "prepared consumer branches").add(stats.prepared),
        gauge(
            "twopc_cursor_refusing_writes",
            "1 once a write failed after its records were applied: restart the server",
        ).add(int(stats.refusing_writes)),
        counter("twopc_cursor_expired_swept", "expired messages the sweep moved to a DLQ").add(
            0 if sweeper is None else sweeper.swept
        ),
    ]


FamiliesSource = Callable[[], list[Family]]
