"""`CursorState`: what the cursor's records mean, as pure code the journal replays into.

Every ``apply`` is idempotent (a rollover that crashed before deleting its old segment replays
carried records a second time): an ``M`` at or below its stream's filter state, a ``Q`` of a
message already present, an ``H`` of a message not available, a ``P`` of ids already prepared,
a ``K`` already in the monitor queue, all change nothing. Every decision an ``apply`` takes
(replay a dead letter or not, skip a copy for a subscription that is gone) depends only on
records before it, and the live cursor applies records in the journal's order
(`CursorBase._append` queues and applies under one lock), so a replay takes the same decision.
The one record applied after its write, ``M`` (its filter must not run ahead of the disk),
carries its verdict.

Entries are keyed by ``key``: the message id for a queue's message, ``<id>@<queue>`` for a
topic copy (one per subscription; the copies share the message, and its id is what consumers
see), so ``H``/``P``/``C``/``R`` records name keys and need nothing topic-specific.

Why one module: every record kind's ``apply`` is here, so replay's idempotence and the one-order
rule are checked in one file; the live cursor's concerns are split over its mixins, and their
records all meet here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from resource_managers.message_log import TOPIC_PREFIX, TRANSACTIONAL_HEADER, Message
from resource_managers.sequencing import StreamState, claim

from ._records import DLQ_SUFFIX, message_obj, to_message

NACK_HEADER = "twopc-nack"
REJECTED = "rejected: a transactional message arrived at non-transactional queue {queue!r}"


def is_topic(destination: str) -> bool:
    """A publication's destination (``topic:<name>``), not a subscription's queue."""
    return destination.startswith(TOPIC_PREFIX) and "/" not in destination


def is_subscription_queue(queue: str) -> bool:
    return queue.startswith(TOPIC_PREFIX) and "/" in queue


class Credit:
    """A pre-count the live cursor holds for a message: the forced record whose ``p`` raised
    its count ahead of its next delivery. ``durable`` is None while that record is being
    written, then True, or False if it failed. A delivery may consume a credit only once it
    is durable (a receive that finds it pending waits), so a count is never low."""

    __slots__ = ("carried", "durable", "keys", "ticket")

    def __init__(self, keys: list[str], ticket: Any = None) -> None:
        self.keys = keys
        self.durable: bool | None = None
        #: a lazy record's journal ticket (an ``M`` pre-counted at arrival): durable once done
        #: without error, instead of being settled by a writer thread
        self.ticket = ticket
        #: raised by a carried branch's payload (`._carried`): settled True once the last
        #: resource committed it; until then no other branch consumes it
        self.carried = False


class StagedBranch:
    """A branch staged for a carried commit: its ``C`` record (without ``v``; the payload is its
    encoding) and the credits its pre-counts granted (pending until the commit point)."""

    __slots__ = ("credit", "record")

    def __init__(self, record: dict[str, Any], credit: Credit | None) -> None:
        self.record = record
        self.credit = credit


@dataclass
class Entry:
    """One accepted message (or topic copy) not yet consumed: where it waits, how often it was
    handed out."""

    message: Message
    order: int  # arrival order: FIFO within a queue and priority
    count: int = 0  # deliveries so far (``H`` records with ``c`` = 1) and pre-counts (``p``)
    queue: str = ""  # where it waits now: ``home``, or ``<home>.DLQ``
    reason: str | None = None  # why it is in the dead-letter queue
    key: str = ""  # the message id, or ``<id>@<subscription queue>`` for a copy
    home: str = ""  # its queue when alive: the destination or the subscription queue
    #: in memory only, never replayed: the pre-count its next delivery consumes instead of
    #: raising the count again (`Credit`); None: that delivery writes a forced ``H``
    credit: Credit | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.key = self.key or self.message.message_id
        self.home = self.home or self.message.destination
        self.queue = self.queue or self.home


class Fifo:
    """A queue's available entries: higher priority first, arrival order within a priority.

    One ordered dict per priority level, so adding at the tail is O(1). An entry returned by a
    rollback belongs before later arrivals: its level is marked and re-sorted once, at the next
    read, so a rollback that returns a thousand entries behind a deep backlog sorts the level
    once, not a thousand times (the message log's streams had that quadratic; this had it too)."""

    __slots__ = ("_levels", "_unsorted", "_where")

    def __init__(self) -> None:
        self._levels: dict[int, dict[str, int]] = {}  # priority -> key -> order
        self._where: dict[str, int] = {}  # key -> priority
        self._unsorted: set[int] = set()  # levels an entry joined out of order

    def add(self, key: str, priority: int, order: int) -> None:
        if key in self._where:
            return
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = {}
            self._levels = dict(sorted(self._levels.items(), reverse=True))
        last = next(reversed(level), None)
        level[key] = order
        self._where[key] = priority
        if last is not None and level[last] > order:
            self._unsorted.add(priority)

    def discard(self, key: str) -> bool:
        priority = self._where.pop(key, None)
        if priority is None:
            return False
        level = self._levels[priority]
        del level[key]
        if not level:
            del self._levels[priority]
            self._unsorted.discard(priority)
        return True

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        """Callers do not change the queue while they iterate (they collect, then apply)."""
        self._sort()
        for level in self._levels.values():
            yield from level

    def __len__(self) -> int:
        return len(self._where)

    def first(self) -> str | None:
        self._sort()
        for level in self._levels.values():
            return next(iter(level))
        return None

    def _sort(self) -> None:
        for priority in self._unsorted:
            level = self._levels[priority]
            self._levels[priority] = dict(sorted(level.items(), key=lambda kv: kv[1]))
        self._unsorted.clear()


@dataclass
class SubscriptionState:
    topic: str
    name: str
    durable: bool


@dataclass
class Taken:
    """An in-doubt publication: taken off the topic input by ``worker``, fanning out to
    ``queues`` (the subscriptions when it was taken)."""

    worker: str
    queues: tuple[str, ...]
    monitor: dict[str, str] = field(default_factory=dict)  # queue -> thread that delivered


class CursorState:
    """Filter state, messages, available queues, branches, tombstones, subscriptions, and the
    topic dispatch's input, in-doubt list and monitor queue."""

    def __init__(self) -> None:
        #: stream key (`sequencing.stream_key`: ``<log>|<stream>``, or a bare stream) -> state
        self.filter: dict[str, StreamState] = {}
        #: log identity -> the newest incarnation that announced it (``L``): older ones are fenced
        self.logs: dict[str, int] = {}
        self.entries: dict[str, Entry] = {}
        self.available: dict[str, Fifo] = {}
        self.handed: dict[str, list[str]] = {}  # gid -> keys handed out, not prepared
        self.prepared: dict[str, list[str]] = {}  # gid -> keys prepared for deletion
        self.tombstones: dict[str, int] = {}  # gid -> wall-clock ms of the rollback
        self.committed: set[str] = set()  # gids whose commit record is in the journal
        self.next_order = 0
        self.non_transactional: set[str] = set()
        #: subscription queue -> subscription (durable ones from records; non-durable in memory)
        self.subscriptions: dict[str, SubscriptionState] = {}
        self.inbox: dict[str, None] = {}  # publications not yet taken, in arrival order
        self.taken: dict[str, Taken] = {}  # the in-doubt list, in take order
        #: gids of carried commits (``C`` with ``v``) not yet forgotten (``D``): `._carried`
        self.remembered: set[str] = set()
        #: coordinator nodes whose carried commits a crash may have left unapplied here (``O``)
        self.carriers: set[str] = set()

    # -- queries -------------------------------------------------------------------------------

    def queue(self, name: str) -> Fifo:
        fifo = self.available.get(name)
        if fifo is None:
            fifo = self.available[name] = Fifo()
        return fifo

    def first_available(self, queue: str) -> str | None:
        fifo = self.available.get(queue)
        return fifo.first() if fifo else None

    def expired_head(self, queue: str, now_ms: int) -> list[str]:
        """The run of expired messages at the head of ``queue`` (dead letters never expire)."""
        out: list[str] = []
        if queue.endswith(DLQ_SUFFIX):
            return out
        for key in self.available.get(queue, ()):
            expires = self.entries[key].message.expires_at
            if expires is None or expires > now_ms:
                break
            out.append(key)
        return out

    def branch_ids(self, gid: str) -> list[str]:
        return [*self.handed.get(gid, ()), *self.prepared.get(gid, ())]

    def topic_queues(self, topic: str) -> tuple[str, ...]:
        return tuple(q for q, s in self.subscriptions.items() if s.topic == topic)

    # -- records -------------------------------------------------------------------------------

    def apply(self, r: dict[str, Any]) -> None:
        getattr(self, _APPLY[r["k"]])(r)

    def _filter_state(self, r: dict[str, Any]) -> None:
        old = self.filter.get(r["q"], StreamState())
        new = StreamState(r["e"], r["l"])
        if (new.epoch, new.last) > (old.epoch, old.last):
            self.filter[r["q"]] = new
            claim(self.filter, r["q"], new.epoch)

    def _log_announced(self, r: dict[str, Any]) -> None:
        """``L``: a log's process announced its incarnation; the newest one wins."""
        self.logs[r["s"]] = max(self.logs.get(r["s"], 0), r["n"])

    def _handed_record(self, r: dict[str, Any]) -> None:
        self._hand_out(r["g"], r["i"], counted=r["c"] == 1)
        self._precount(r.get("p", ()))

    def _prepare_record(self, r: dict[str, Any]) -> None:
        self._prepare(r["g"], r["i"])
        self._precount(r.get("p", ()))

    def _commit_record(self, r: dict[str, Any]) -> None:
        self._commit(r["g"], r["i"])
        self._precount(r.get("p", ()))
        if r.get("v"):  # a carried commit: remembered until its decision row is gone
            self.remembered.add(r["g"])
        self.remembered.difference_update(r.get("f", ()))

    def _carriers(self, r: dict[str, Any]) -> None:
        """``O``: the nodes whose carried commits an open must wait for recovery to restore."""
        self.carriers = set(r["d"])

    def _remember(self, r: dict[str, Any]) -> None:
        self.remembered.update(r["b"])

    def _forget_remembered(self, r: dict[str, Any]) -> None:
        self.remembered.difference_update(r["b"])

    def _precount(self, keys: Iterable[str]) -> None:
        """``p``: raise counts ahead of delivery, whatever the record's own verdict (a ``P``
        after a tombstone changes nothing else, but the live cursor granted credits for it).
        Not idempotent, and need not be: a rollover carries counts in ``Q``, never ``p``."""
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None:
                entry.count += 1

    def _rollback_record(self, r: dict[str, Any]) -> None:
        self._rollback(r["g"], r["t"], r["i"], r["x"])

    def _given_back(self, r: dict[str, Any]) -> None:
        """``G``: pre-counts a clean close found unused (their messages never handed out)."""
        for key in r["i"]:
            entry = self.entries.get(key)
            if entry is not None and entry.count > 0:
                entry.count -= 1
                entry.credit = None

    def _forget(self, r: dict[str, Any]) -> None:
        self.tombstones.pop(r["g"], None)

    def _expired_dropped(self, r: dict[str, Any]) -> None:
        """``X``: written by versions before expired messages went to dead-letter queues."""
        for key in r["i"]:
            entry = self.entries.get(key)
            if entry is not None and self.queue(entry.queue).discard(key):
                del self.entries[key]

    def _expired_moved(self, r: dict[str, Any]) -> None:
        for key in r["i"]:
            entry = self.entries.get(key)
            if entry is not None and key in self.queue(entry.queue):
                self._to_dead_letters(entry, r["r"])

    def _queue_kind(self, r: dict[str, Any]) -> None:
        if r["v"]:
            self.non_transactional.discard(r["u"])
        else:
            self.non_transactional.add(r["u"])

    def _subscribed(self, r: dict[str, Any]) -> None:
        queue = f"{r['u']}/{r['s']}"
        self.subscriptions.setdefault(queue, SubscriptionState(r["u"], r["s"], True))

    def _unsubscribed(self, r: dict[str, Any]) -> None:
        self.remove_subscription(f"{r['u']}/{r['s']}")

    def _taken(self, r: dict[str, Any]) -> None:
        if r["m"] in self.inbox:
            del self.inbox[r["m"]]
            self.taken[r["m"]] = Taken(r["w"], tuple(r["z"]))

    def _copied(self, r: dict[str, Any]) -> None:
        self._copy(r["m"], r["u"], r["w"], create=True)

    def _monitored(self, r: dict[str, Any]) -> None:
        self._copy(r["m"], r["u"], r["w"], create=False)

    def _finished(self, r: dict[str, Any]) -> None:
        if self.taken.pop(r["m"], None) is not None:
            self.entries.pop(r["m"], None)

    def _replayed(self, r: dict[str, Any]) -> None:
        for key in r["i"]:
            entry = self.entries.get(key)
            if entry is None or entry.reason is None or not self.replayable(entry):
                continue
            if self._unqueue(entry):
                entry.queue, entry.reason, entry.count = entry.home, None, 0
                entry.credit = None  # the count it stood for is gone
                entry.order = self.next_order
                self.next_order += 1
                self._make_available(entry)

    def _purged(self, r: dict[str, Any]) -> None:
        for key in r["i"]:
            entry = self.entries.get(key)
            if entry is not None and self._unqueue(entry):
                del self.entries[key]

    def replayable(self, entry: Entry) -> bool:
        """A dead letter may go back to its queue unless its subscription is gone or the queue
        would reject it again (a transactional message at a non-transactional queue)."""
        if self._orphan(entry.home):
            return False
        return not (entry.message.transactional and entry.home in self.non_transactional)

    def _orphan(self, home: str) -> bool:
        return is_subscription_queue(home) and home not in self.subscriptions

    def _unqueue(self, entry: Entry) -> bool:
        """Take an available entry out of its queue (False if it is handed out)."""
        return self.queue(entry.queue).discard(entry.key)

    def _accept(self, r: dict[str, Any]) -> None:
        """``M``: a transferred message, into its queue, the topic input, or (rejected) its
        dead-letter queue with a negative acknowledgment."""
        old = self.filter.get(r["q"], StreamState())
        if (r["e"], r["n"]) <= (old.epoch, old.last):
            return  # applied before
        self.filter[r["q"]] = StreamState(r["e"], r["n"])
        claim(self.filter, r["q"], r["e"])
        message = to_message(r["o"])
        if message.message_id in self.entries:
            return
        entry = Entry(message, self.next_order)
        if r.get("j"):  # the verdict the cursor took when it wrote the record
            entry.queue = message.destination + DLQ_SUFFIX
            entry.reason = REJECTED.format(queue=message.destination)
            self._add(entry)
            self._nack(message)
        else:
            entry.count = 1 if r.get("p") else 0  # pre-counted at arrival: its own key
            self._add(entry)

    def _nack(self, message: Message) -> None:
        """MSMQ: the negative acknowledgment to the administration queue the message named."""
        admin = message.admin_queue
        if admin is None or is_subscription_queue(admin):
            return
        nack = Message(
            message.message_id + ".nack",
            admin,
            message.body,
            {
                NACK_HEADER: "non-transactional-queue",
                TRANSACTIONAL_HEADER: "0",  # the cursor's own notice, not a transaction's
                "twopc-original-id": message.message_id,
                "twopc-original-destination": message.destination,
            },
        )
        if nack.message_id not in self.entries:
            self._add(Entry(nack, self.next_order))

    def _carried(self, r: dict[str, Any]) -> None:
        message = to_message(r["o"])
        key = r.get("y", message.message_id)
        home = r.get("h", message.destination)
        if key in self.entries:
            return
        if key != message.message_id and home not in self.subscriptions and r["r"] is None:
            return  # a copy for a subscription that is gone
        self._add(Entry(message, r["a"], r["c"], r["u"], r["r"], key, home))

    def _add(self, entry: Entry) -> None:
        self.entries[entry.key] = entry
        self.next_order = max(self.next_order, entry.order + 1)
        self._make_available(entry)

    def _make_available(self, entry: Entry) -> None:
        if entry.reason is None and is_topic(entry.queue):
            self.inbox[entry.key] = None  # a publication: the dispatcher takes it from here
            return
        self.queue(entry.queue).add(entry.key, entry.message.priority, entry.order)

    def _to_dead_letters(self, entry: Entry, reason: str) -> None:
        self._unqueue(entry)
        entry.queue, entry.reason = entry.home + DLQ_SUFFIX, reason
        self._make_available(entry)

    def _copy(self, mid: str, queue: str, by: str, *, create: bool) -> None:
        taken = self.taken.get(mid)
        if taken is None or queue in taken.monitor:
            return
        taken.monitor[queue] = by
        source = self.entries.get(mid)
        key = f"{mid}@{queue}"
        if (
            create
            and source is not None
            and queue in self.subscriptions
            and key not in self.entries
        ):
            self._add(Entry(source.message, self.next_order, key=key, home=queue))

    def remove_subscription(self, queue: str) -> int:
        """Drop a subscription and its available copies (dead letters stay); how many."""
        if self.subscriptions.pop(queue, None) is None:
            return 0
        fifo = self.available.pop(queue, None)
        for key in list(fifo or ()):
            self.entries.pop(key, None)
        return len(fifo or ())

    def _hand_out(self, gid: str, keys: list[str], counted: bool) -> None:
        for key in keys:
            entry = self.entries.get(key)
            if entry is None or not self._unqueue(entry):
                continue  # applied before, or consumed since
            if counted:
                entry.count += 1
            self.handed.setdefault(gid, []).append(key)

    def _prepare(self, gid: str, keys: list[str]) -> None:
        if gid in self.committed or gid in self.tombstones or gid in self.prepared:
            return
        handed = self.handed.pop(gid, [])
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None and key not in handed:  # carried: take it from its queue
                self._unqueue(entry)
        self.prepared[gid] = [key for key in keys if key in self.entries]

    def _commit(self, gid: str, keys: list[str]) -> None:
        self.committed.add(gid)
        others = self._end_branch(gid, keys)
        for key in keys:
            entry = self.entries.pop(key, None)
            if entry is not None:
                self._unqueue(entry)
        self._put_back(others)

    def _end_branch(self, gid: str, keys: list[str]) -> list[str]:
        """Forget branch ``gid``; the keys it held that its ending record does not name (taken
        by a receive that raced the commit or rollback): they must not be left in limbo."""
        held = [*self.handed.pop(gid, ()), *self.prepared.pop(gid, ())]
        named = set(keys)
        return [key for key in held if key not in named]

    def _put_back(self, keys: list[str]) -> None:
        for key in keys:
            entry = self.entries.get(key)
            if entry is None or key in self.queue(entry.queue):
                continue
            if entry.reason is None and self._orphan(entry.home):
                del self.entries[key]  # a copy whose (non-durable) subscription is gone
            else:
                self._make_available(entry)

    def _rollback(self, gid: str, at: int, keys: list[str], moves: list[list[str]]) -> None:
        self.tombstones[gid] = at
        others = self._end_branch(gid, keys + [key for key, _ in moves])
        self._put_back(keys + others)
        for key, reason in moves:
            entry = self.entries.get(key)
            if entry is not None and entry.reason is None:
                self._to_dead_letters(entry, reason)

    def live_records(self, now_ms: int, tombstone_ms: int) -> list[dict[str, Any]]:
        """What a rollover carries: filter states, queue kinds, durable subscriptions, messages,
        the in-doubt list with its monitor entries, branches, young tombstones, the carriers
        and the remembered carried gids."""
        out: list[dict[str, Any]] = [
            {"k": "S", "q": q, "e": s.epoch, "l": s.last} for q, s in self.filter.items()
        ]
        out += [{"k": "L", "s": log, "n": n} for log, n in self.logs.items()]
        out += [{"k": "T", "u": q, "v": False} for q in sorted(self.non_transactional)]
        out += [{"k": "U", "u": s.topic, "s": s.name}
                for s in self.subscriptions.values() if s.durable]  # fmt: skip
        for e in sorted(self.entries.values(), key=lambda e: e.order):
            if e.key != e.message.message_id and e.reason is None:
                sub = self.subscriptions.get(e.home)
                if sub is None or not sub.durable:
                    continue  # a non-durable subscription does not outlive this process
            record = {"k": "Q", "o": message_obj(e.message), "a": e.order, "c": e.count,
                      "u": e.queue, "r": e.reason}  # fmt: skip
            if e.key != e.message.message_id:
                record |= {"y": e.key, "h": e.home}
            out.append(record)
        for mid, t in self.taken.items():
            out.append({"k": "I", "m": mid, "w": t.worker, "z": list(t.queues)})
            out += [{"k": "N", "m": mid, "u": q, "w": by} for q, by in t.monitor.items()]
        out += [{"k": "H", "g": g, "i": ids, "c": 0} for g, ids in self.handed.items()]
        out += [{"k": "P", "g": g, "i": ids} for g, ids in self.prepared.items()]
        for gid, at in self.tombstones.items():
            if now_ms - at < tombstone_ms:
                out.append({"k": "R", "g": gid, "t": at, "i": [], "x": []})
        if self.carriers:
            out.append({"k": "O", "d": sorted(self.carriers)})
        if self.remembered:
            out.append({"k": "A", "b": sorted(self.remembered)})
        return out


#: record kind -> the `CursorState` method that applies it
_APPLY = {
    "M": "_accept", "Q": "_carried", "S": "_filter_state", "H": "_handed_record",
    "P": "_prepare_record", "C": "_commit_record", "R": "_rollback_record", "F": "_forget",
    "X": "_expired_dropped", "W": "_expired_moved", "T": "_queue_kind", "U": "_subscribed",
    "V": "_unsubscribed", "I": "_taken", "K": "_copied", "N": "_monitored", "E": "_finished",
    "Y": "_replayed", "Z": "_purged", "G": "_given_back", "L": "_log_announced",
    "O": "_carriers", "A": "_remember", "D": "_forget_remembered",
}  # fmt: skip
