"""The per-message shortcuts of the message path keep the full rules: a message checked once is
judged again by its recorded size only, and a store applying its own record gets back the
`Message` it wrote, while a record read from disk still goes through the strict decoder."""

from __future__ import annotations

import dataclasses
import json
import os
import uuid

import pytest

from coordinator.errors import LogCorruptionError
from resource_managers.message_log import InvalidMessageError, Message, check_message
from resource_managers.message_log._ids import new_id
from resource_managers.message_log._records import decode, encode, message_obj, to_message


def message(**changes: object) -> Message:
    m = Message("id-1", "q", b"\x00\xfe\xd1body", {"k": "v"}, True, None)
    return dataclasses.replace(m, **changes)  # type: ignore[arg-type]


def test_a_checked_message_is_judged_again_by_its_size_only() -> None:
    m = message()
    assert check_message(m, max_bytes=m.size) is m
    assert check_message(m) is m
    with pytest.raises(InvalidMessageError, match=f"message of {m.size} bytes"):
        check_message(m, max_bytes=m.size - 1)


def test_a_message_that_failed_is_checked_in_full_every_time() -> None:
    bad = message(headers={"twopc-priority": "x"})
    for _ in range(2):
        with pytest.raises(InvalidMessageError, match="priority"):
            check_message(bad)


def test_a_copy_with_other_fields_is_not_taken_for_checked() -> None:
    m = check_message(message())
    with pytest.raises(InvalidMessageError, match="destination"):
        check_message(dataclasses.replace(m, destination="bad dest"))


def test_a_store_applying_its_own_record_gets_the_same_message_back() -> None:
    m = check_message(message(expires_at=5, persistent=False))
    obj = message_obj(m)
    assert to_message(obj) is m
    payload = encode({"k": "P", "g": "g1", "m": [obj]})
    assert payload == encode({"k": "P", "g": "g1", "m": [dict(obj)]})  # same bytes on disk
    replayed = decode(payload)["m"][0]
    assert type(replayed) is dict and to_message(replayed) == m


def test_a_record_read_from_disk_is_still_checked_strictly() -> None:
    obj = dict(message_obj(message()))
    obj["b"] = "not base64!"
    with pytest.raises(LogCorruptionError):
        decode(json.dumps({"k": "P", "g": "g1", "m": [obj]}).encode())


def test_records_encode_as_the_old_compact_ascii_json() -> None:
    """Journals written before must read the same: the encoder made once writes what
    ``json.dumps(separators=(",", ":"), ensure_ascii=True)`` wrote per call."""
    m = message(headers={"é": "ü\u2028", "k": '"q"'}, expires_at=2**40)
    for record in (
        {"k": "1", "g": "g1", "m": [message_obj(m)], "s": [["q", 1]]},
        {"k": "M", "q": "q", "e": 1, "n": 2, "o": message_obj(m), "j": True},
        {"k": "R", "g": "g", "t": 0, "i": [], "x": [["id", "reason\n"]]},
    ):
        want = json.dumps(record, separators=(",", ":"), ensure_ascii=True).encode("ascii")
        assert encode(record) == want


def test_message_ids_are_uuid4_and_a_forked_child_does_not_repeat_its_parents() -> None:
    """Ids come from a block of os.urandom (one system call per 256 ids, not per message); a
    forked child holds a copy of that block and must not hand out the ids the parent will."""
    ids = [new_id() for _ in range(600)]  # more than one block
    assert len(set(ids)) == 600
    assert all(uuid.UUID(i).version == 4 and uuid.UUID(i).hex == i for i in ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write, new_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    os.close(write)
    assert child != new_id()


@pytest.mark.parametrize(
    "headers", [{}, {"k": "v"}, {"é": "ü€", "id": "x" * 300, "twopc-priority": "7"}], ids=repr
)
def test_a_messages_size_is_its_body_and_headers_in_utf8(headers: dict[str, str]) -> None:
    m = message(headers=headers)
    expected = len(m.body) + sum(len(k.encode()) + len(v.encode()) for k, v in headers.items())
    assert m.size == expected


def test_an_accepted_destination_is_remembered_and_a_refused_one_never() -> None:
    for _ in range(2):  # the second time from the memory of accepted ones
        assert check_message(message(destination="orders.eu")).destination == "orders.eu"
        for bad in ("orders.DLQ", "topic:prices/sub", "-bad", "x" * 201):
            with pytest.raises(InvalidMessageError):
                check_message(message(destination=bad))
