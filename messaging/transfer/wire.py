"""A transferred message on the wire: `frames.Msg` to and from the stores' values.

Only this module knows how a `Message` and its stream numbers map onto a MSG frame, so the log's
sender and the cursor's receiver cannot disagree about it.
"""

from __future__ import annotations

from coordinator.errors import FrameError
from resource_managers.message_log import InvalidMessageError, Message, validate_destination
from resource_managers.sequencing import Frame

from ..frames import Msg


def to_wire(frame: Frame, message: Message) -> Msg:
    return Msg(
        stream=frame.stream,
        epoch=frame.epoch,
        seq=frame.seq,
        prev=frame.prev,
        message_id=message.message_id,
        destination=message.destination,
        body=message.body,
        headers=dict(message.headers),
        expires_at_ms=message.expires_at,
        persistent=message.persistent,
    )


def from_wire(msg: Msg) -> tuple[Frame, Message]:
    """The numbers (impossible ones raise `FrameError`: drop the connection) and the message
    (one no log could have written raises `InvalidMessageError`: refuse it, keep the
    connection)."""
    frame = Frame(msg.stream, msg.epoch, msg.seq, msg.prev, msg.message_id)
    headers = dict(msg.headers)
    if not all(isinstance(v, str) for v in headers.values()):
        raise InvalidMessageError(f"message {msg.message_id}: header values must be strings")
    expires = msg.expires_at_ms
    if expires is not None and expires < 0:
        raise FrameError(f"message {msg.message_id}: negative expiry {expires}")
    message = Message(
        msg.message_id,
        validate_destination(msg.destination),
        msg.body,
        {k: str(v) for k, v in headers.items()},
        msg.persistent,
        expires,
    )
    if message.stream != frame.stream:
        raise InvalidMessageError(
            f"message {msg.message_id} for {message.stream!r} arrived on stream {frame.stream!r}"
        )
    return frame, message
