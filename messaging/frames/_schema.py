"""The frames as dataclasses, each with its wire schema (field conversions checked both ways)."""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import (
    Any,
    ClassVar,
    TypeAlias,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

from coordinator.errors import ProgrammingError
from coordinator.xid import Xid

from ._base import PROTOCOL_VERSION, FrameType, Value

# -- frame schemas -------------------------------------------------------------------------------

_Conv = Callable[[Any], Any]


def _exact(kind: type) -> tuple[_Conv, _Conv]:
    def check(v: Any) -> Any:
        if type(v) is not kind:  # bool is an int, and a seq number is not a bool
            raise TypeError(f"expected {kind.__name__}, got {type(v).__name__}")
        return v

    return check, check


def _xid_to_wire(v: Any) -> Value:
    if not isinstance(v, Xid):
        raise TypeError(f"expected Xid, got {type(v).__name__}")
    return [v.format_id, v.gtrid, v.bqual]


def _xid_from_wire(v: Any) -> Xid:
    if not (isinstance(v, list) and len(v) == 3):
        raise TypeError("an xid is [format_id, gtrid, bqual]")
    return Xid(*v)  # validates: a malformed xid never gets past the boundary


def _convs(hint: Any) -> tuple[_Conv, _Conv]:
    """(to_wire, from_wire) for a field's annotation; both check types, raising TypeError."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Xid:
        return _xid_to_wire, _xid_from_wire
    if hint in (bool, int, float, str, bytes):
        return _exact(hint)
    if origin in (Union, types.UnionType) and len(args) == 2 and type(None) in args:
        to_inner, from_inner = _convs(next(a for a in args if a is not type(None)))
        return (lambda v: None if v is None else to_inner(v)), (
            lambda v: None if v is None else from_inner(v)
        )
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        to_item, from_item = _convs(args[0])

        def to_seq(v: Any) -> list[Any]:
            if not isinstance(v, (list, tuple)):
                raise TypeError(f"expected a sequence, got {type(v).__name__}")
            return [to_item(i) for i in v]

        def from_seq(v: Any) -> tuple[Any, ...]:
            if not isinstance(v, list):
                raise TypeError(f"expected a list, got {type(v).__name__}")
            return tuple(from_item(i) for i in v)

        return to_seq, from_seq
    if origin is Mapping:

        def check_map(v: Any) -> Any:
            if not isinstance(v, Mapping):
                raise TypeError(f"expected a map, got {type(v).__name__}")
            return v

        return check_map, check_map  # a decoded map is a fresh dict already
    raise TypeError(f"no wire form for annotation {hint!r}")


@dataclass(frozen=True)
class _Field:
    name: str
    required: bool
    default: Callable[[], Any]
    to_wire: _Conv
    from_wire: _Conv


_T = TypeVar("_T")
_SCHEMAS: dict[FrameType, tuple[type[Any], tuple[_Field, ...]]] = {}


def _frame(*types_: FrameType) -> Callable[[type[_T]], type[_T]]:
    """Register a frame dataclass for its frame types: its annotations are its wire schema.

    A field named ``verb`` is the frame type itself, carried by the header, not the payload.
    """

    def register(cls: type[_T]) -> type[_T]:
        hints = get_type_hints(cls)
        specs = []
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name == "verb":
                continue
            factory: Any = f.default_factory
            default = factory if factory is not MISSING else (lambda d=f.default: d)
            required = f.default is MISSING and factory is MISSING
            specs.append(_Field(f.name, required, default, *_convs(hints[f.name])))
        for ftype in types_:
            _SCHEMAS[ftype] = (cls, tuple(specs))
        return cls

    return register


@_frame(FrameType.HELLO)
@dataclass(frozen=True, slots=True)
class Hello:
    """Server -> client, first on every connection: a fresh challenge nonce and our versions."""

    TYPE: ClassVar[FrameType] = FrameType.HELLO
    nonce: bytes
    server_id: str
    versions: tuple[int, ...] = (PROTOCOL_VERSION,)


@_frame(FrameType.AUTH)
@dataclass(frozen=True, slots=True)
class Auth:
    """Client -> server: the proof that we hold the secret, bound to this connection's nonces."""

    TYPE: ClassVar[FrameType] = FrameType.AUTH
    client_id: str
    nonce: bytes
    role: str
    version: int
    proof: bytes


@_frame(FrameType.WELCOME)
@dataclass(frozen=True, slots=True)
class Welcome:
    """Server -> client: accepted, and the server's own proof (mutual authentication)."""

    TYPE: ClassVar[FrameType] = FrameType.WELCOME
    proof: bytes


@_frame(FrameType.ERROR)
@dataclass(frozen=True, slots=True)
class ErrorFrame:
    """Sent just before closing: a stable ``code`` (``bad-frame``, ``auth-failed``...) and text."""

    TYPE: ClassVar[FrameType] = FrameType.ERROR
    code: str
    message: str = ""


@_frame(FrameType.PING)
@dataclass(frozen=True, slots=True)
class Ping:
    """Liveness probe; the peer answers `Pong` with the same token."""

    TYPE: ClassVar[FrameType] = FrameType.PING
    token: int = 0


@_frame(FrameType.PONG)
@dataclass(frozen=True, slots=True)
class Pong:
    TYPE: ClassVar[FrameType] = FrameType.PONG
    token: int = 0


@_frame(FrameType.MSG)
@dataclass(frozen=True, slots=True)
class Msg:
    """One committed message of a stream. The cursor accepts it only if ``seq`` is above the last
    number it accepted in (``stream``, ``epoch``) and ``prev`` is not (the messages between were
    acknowledged or expired; see `resource_managers.sequencing.classify`); ``seq`` becomes the
    new last. ``expires_at_ms``
    is wall-clock milliseconds since the Unix epoch, None for never."""

    TYPE: ClassVar[FrameType] = FrameType.MSG
    stream: str
    epoch: int
    seq: int
    prev: int
    message_id: str
    destination: str
    body: bytes
    headers: Mapping[str, Value] = field(default_factory=dict)
    expires_at_ms: int | None = None
    persistent: bool = True
    redelivered: bool = False
    delivery_count: int = 0


@dataclass(frozen=True, slots=True)
class MsgBatch:
    """Version 3: consecutive MSG frames of one connection as one frame (`_batch` gives its
    layout). `messaging.connection.Connection` makes and unmakes them: a sender hands it Msgs,
    a reader gets Msgs back, in order."""

    TYPE: ClassVar[FrameType] = FrameType.MSGS
    messages: tuple[Msg, ...]


@_frame(FrameType.ACK)
@dataclass(frozen=True, slots=True)
class Ack:
    """Order acknowledgment: every message of (``stream``, ``epoch``) up to ``seq`` is durable."""

    TYPE: ClassVar[FrameType] = FrameType.ACK
    stream: str
    epoch: int
    seq: int


@_frame(FrameType.NACK)
@dataclass(frozen=True, slots=True)
class Nack:
    """The receiver refuses message ``seq`` for good; ``reason`` is a stable code."""

    TYPE: ClassVar[FrameType] = FrameType.NACK
    stream: str
    epoch: int
    seq: int
    reason: str
    detail: str = ""


@_frame(FrameType.ORIGIN)
@dataclass(frozen=True, slots=True)
class Origin:
    """Log -> cursor, the first frame of a transfer in version 2: the log's durable identity
    (its streams at the cursor are its own) and the incarnation of the process sending, so a
    cursor can refuse an older process that claims the same identity."""

    TYPE: ClassVar[FrameType] = FrameType.ORIGIN
    log: str
    incarnation: int


XA_VERBS = frozenset(FrameType(t) for t in range(FrameType.XA_START, FrameType.XA_FORGET + 1))


@_frame(*sorted(XA_VERBS))
@dataclass(frozen=True, slots=True)
class XaRequest:
    """An XA verb (``XA_START`` .. ``XA_FORGET``) for a remote resource; ``verb`` is the frame type.

    ``args`` is open on purpose: each verb defines its keys (``one_phase`` for commit...).
    ``request_id`` pairs the `XaReply`; ``xid`` is validated as an `Xid` when decoded.
    """

    verb: FrameType
    request_id: int
    xid: Xid | None = None
    args: Mapping[str, Value] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.verb not in XA_VERBS:
            raise ProgrammingError(f"{self.verb!r} is not an XA verb")

    @property
    def TYPE(self) -> FrameType:
        return self.verb


@_frame(FrameType.XA_REPLY)
@dataclass(frozen=True, slots=True)
class XaReply:
    """The answer to request ``request_id``: ``status`` "ok" or an error code, and a result map
    (``vote``, ``outcome``, ``xids``...) whose keys the verb defines."""

    TYPE: ClassVar[FrameType] = FrameType.XA_REPLY
    request_id: int
    status: str = "ok"
    result: Mapping[str, Value] = field(default_factory=dict)
    message: str = ""


Frame: TypeAlias = (
    Hello
    | Auth
    | Welcome
    | ErrorFrame
    | Ping
    | Pong
    | Msg
    | MsgBatch
    | Ack
    | Nack
    | Origin
    | XaRequest
    | XaReply
)
