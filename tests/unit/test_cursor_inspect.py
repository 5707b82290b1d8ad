"""``twopc log inspect`` names every kind of cursor record, the carried branches' included."""

from __future__ import annotations

from resource_managers.cursor._inspect import KINDS, inspect_record
from resource_managers.cursor._records import _SCHEMA, encode


def test_every_record_kind_has_a_name() -> None:
    assert set(_SCHEMA) <= set(KINDS)


def test_carried_records_read_by_name() -> None:
    rows = [
        inspect_record(encode(r))
        for r in (
            {"k": "O", "d": ["node-1"]},
            {"k": "C", "g": "not-a-gid", "i": ["m1"], "v": True, "f": ["g0"]},
            {"k": "A", "b": ["g1"]},
            {"k": "D", "b": ["g1"]},
        )
    ]
    assert rows[0] == {"kind": "CARRIERS", "nodes": ["node-1"]}
    assert rows[1]["kind"] == "COMMIT" and rows[1]["carried"] is True
    assert rows[1]["forgotten"] == ["g0"] and rows[1]["ids"] == ["m1"]
    assert rows[2] == {"kind": "REMEMBERED", "gids": ["g1"]}
    assert rows[3] == {"kind": "FORGOTTEN", "gids": ["g1"]}
