"""JMS-style sessions over the message log and the cursor: the four acknowledgment modes (JMS).

A `Session` is what a JMS client holds: it sends to the message log and receives from the
cursor, and its `AckMode` says when what it received is *acknowledged*, that is when the cursor
deletes it. Every acknowledgment here is a real cursor transaction through the
`TransactionManager`: taking a message raises its delivery count durably first (the cursor's
forced ``H`` record, or the pre-count the previous acknowledgment's forced record made),
acknowledging commits the transaction (the forced ``C`` record, or two-phase when other branches
joined), and anything not acknowledged when the process dies comes back at the
cursor's next open with ``redelivered`` set and its count kept. So the guarantee of each mode is
exactly which transaction a crash can catch open:

- ``AUTO``: one transaction per message, committed when the handler returns (`consume`) or, for
  `receive`, when the application comes back (the next receive, `acknowledge`, `close`). A crash
  can only catch the last message, which comes back redelivered: JMS's "only the most recent
  message received is subject to this ambiguity".
- ``CLIENT``: the received messages accumulate in one transaction until `acknowledge` commits it
  (JMS: acknowledging one message acknowledges every message the session delivered); `recover`
  rolls it back. A crash brings back everything since the last acknowledge.
- ``DUPS_OK``: lazy, batched acknowledgment. Up to ``dups_ok_batch`` messages are taken with
  one ``receive_many`` (pre-counted by the previous batch's commit, or one forced record) and
  committed once the whole batch has been handed out and handled (one forced record). About one
  fsync per batch instead of one or two per message; in exchange a crash brings back at most one
  batch, duplicates an application must tolerate.
- ``TRANSACTED``: receives and sends share one transaction, with whatever the application joins
  through `Session.transaction` (a database, say); `commit`/`rollback` end it and the next
  operation begins another. Nothing committed comes back; nothing rolled back is lost (received
  messages return redelivered, sent messages are never forwarded).

Sending outside ``TRANSACTED`` is synchronous, as JMS's producer: each `send` is its own
one-phase transaction on the log and returns only once the log has accepted responsibility
(the forced record for a persistent message). Such messages are marked non-transactional
(``transactional=False``), so a non-transactional queue accepts them (MSMQ).

A session's transactions are its own: they are begun in a private `contextvars.Context`, so they
never become the thread's current transaction, two sessions in one thread do not collide, and an
application may run `TransactionManager.transaction` blocks while a session holds messages.
A session is not thread-safe (a JMS session is not either); the manager's reaper may still roll
its transaction back after the manager's timeout, which the next call reports as an error.

Crash points (``<mode>`` is the `AckMode` value): ``session.<mode>.after_receive`` (messages
taken, not yet returned), ``session.<mode>.after_handler`` (`consume`: the handler returned, its
message not acknowledged), ``session.<mode>.before_ack`` and ``session.<mode>.after_ack`` around
the commit that acknowledges (in ``TRANSACTED``: `Session.commit`).
"""

from ._session import DEFAULT_DUPS_OK_BATCH, WAIT_SLICE, Session
from ._subscriber import Subscriber
from ._types import AckMode, Handler, Received

__all__ = [
    "DEFAULT_DUPS_OK_BATCH",
    "WAIT_SLICE",
    "AckMode",
    "Handler",
    "Received",
    "Session",
    "Subscriber",
]
