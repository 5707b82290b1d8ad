"""Xid and gtrid rules: the XA and PostgreSQL limits, and the exact in-flight guard's inputs."""

from __future__ import annotations

import pytest

from coordinator import InvalidXidError, Xid
from coordinator.xid import FORMAT_ID, GtridFactory, branches_of, custom_gtrid


def test_gid_round_trip_is_the_psycopg2_jdbc_form() -> None:
    xid = Xid(0, "id-1", "b-1")
    assert xid.to_gid() == "0_aWQtMQ==_Yi0x"  # the example in psycopg2's documentation
    assert Xid.from_gid(xid.to_gid()) == xid


def test_longest_parts_fit_a_postgresql_gid() -> None:
    xid = Xid(2**31 - 1, "g" * 64, "b" * 64)
    assert len(xid.to_gid()) < 200
    assert Xid.from_gid(xid.to_gid()) == xid


def test_factory_gtrids_are_unique_and_carry_node_incarnation_and_sequence() -> None:
    factory = GtridFactory("orders-1")
    gtrids = [factory.next() for _ in range(1000)]
    assert len({g for g, _ in gtrids}) == 1000
    gtrid, seq = gtrids[-1]
    assert factory.own_seq(gtrid) == seq == factory.high_water == 1000
    assert Xid.branch_of(gtrid, "pg").belongs_to("orders-1")
    assert not Xid.branch_of(gtrid, "pg").belongs_to("orders-2")
    assert len(gtrid) <= 64


def test_another_incarnation_is_not_ours() -> None:
    first, second = GtridFactory("n"), GtridFactory("n")
    assert first.incarnation != second.incarnation
    assert second.own_seq(first.next()[0]) is None


def test_foreign_format_id_does_not_belong_to_us() -> None:
    assert not Xid(FORMAT_ID + 1, "n:x-1", "pg").belongs_to("n")
    assert Xid(FORMAT_ID, "n:x-1", "pg").node_id == "n"
    assert Xid(FORMAT_ID, "no-prefix", "pg").node_id is None


def test_custom_gtrid_keeps_the_node_prefix() -> None:
    assert custom_gtrid("spark-1", "app-7.batch-3") == "spark-1:app-7.batch-3"
    with pytest.raises(InvalidXidError):
        custom_gtrid("spark-1", "x" * 64)
    with pytest.raises(InvalidXidError):
        custom_gtrid("bad:node", "x")


def test_branches_of_keeps_only_our_format_and_branch() -> None:
    ours = Xid.branch_of("node-1:x-1", "pg")
    other_branch = Xid.branch_of("node-1:x-2", "redis")
    other_format = Xid(7, "node-1:x-3", "pg")
    gids = [ours.to_gid(), other_branch.to_gid(), other_format.to_gid(), "not-a-gid", "1_'_--"]
    assert branches_of(gids, "pg") == [ours]
