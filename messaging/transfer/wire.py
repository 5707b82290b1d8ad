"""A transferred message on the wire: `frames.Msg` to and from the stores' values.

Only this module knows how a `Message` and its stream numbers map onto a MSG frame, so the log's
sender and the cursor's receiver cannot disagree about it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from coordinator.errors import FrameError
from resource_managers.message_log import (
    InvalidMessageError,
    Message,
    check_message,
    on_its_stream,
)
from resource_managers.sequencing import MAX_NAME_CHARS, Frame, stream_key

from ..frames import Msg, PackedMsg, Value, pack_fields


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


def pack_wire(frame: Frame, message: Message, *, limit: int) -> PackedMsg | Msg:
    """`to_wire` for a connection of protocol version 3 or later: the message packed in the
    MSGS layout straight from the log's values, without a `Msg` in between; or the `Msg`, if the
    layout cannot hold it or it packs to more than ``limit`` bytes (a MSGS frame's room), so
    that it travels as a MSG of its own, as a `Msg` handed to the connection would."""
    packed = pack_fields(
        frame.stream, frame.epoch, frame.seq, frame.prev, message.message_id,
        message.destination, message.body, message.headers, message.expires_at,
        message.persistent, False, 0,
    )  # fmt: skip
    return to_wire(frame, message) if packed is None or len(packed) > limit else packed


def from_wire(msg: Msg, log: str = "") -> tuple[Frame, Message]:
    """The numbers (impossible ones raise `FrameError`: drop the connection) and the message,
    judged by the check every producer's message passes (`check_message`: one no log could have
    written raises `InvalidMessageError`: refuse it, keep the connection). The frame's stream is
    the cursor's key of it: the stream of the log ``log`` ("": a log that named none)."""
    if not 0 < len(msg.stream) <= MAX_NAME_CHARS:  # before it is joined to the log's identity
        raise FrameError(f"stream must be a string of 1-{MAX_NAME_CHARS} characters")
    frame = Frame(stream_key(log, msg.stream), msg.epoch, msg.seq, msg.prev, msg.message_id)
    expires = msg.expires_at_ms
    if expires is not None and expires < 0:
        raise FrameError(f"message {msg.message_id}: negative expiry {expires}")
    message = check_message(
        Message(
            msg.message_id,
            msg.destination,
            msg.body,
            _unchecked(msg.headers),
            msg.persistent,
            expires,
        )
    )
    if not on_its_stream(message, msg.stream):  # a partition's stream: its key's partition
        raise InvalidMessageError(
            f"message {msg.message_id} for {message.stream!r} arrived on stream {msg.stream!r}"
        )
    return frame, message


def _unchecked(headers: Mapping[str, Value]) -> dict[str, str]:
    """The frame's headers as `Message` types them; `check_message` then refuses any that are
    not text (a frame's map may hold any value)."""
    return cast("dict[str, str]", dict(headers))
