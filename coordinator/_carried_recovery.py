"""Recovery's part in carried branches (`coordinator.carried`): restore what a store lost, then
forget what no row needs. `Recovery` calls these once every resource was listed in a pass, and
lends them what they need of the pass through `Pass`."""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from typing import Any, Protocol

from .carried import CarriedBranches, holds, rides
from .crashpoints import crash_point
from .last_resource import LastResource
from .resource import Resource
from .xid import Xid


class Pass(Protocol):
    """What one recovery pass lends: its node, resources, in-flight guard and report."""

    node_id: str

    def ordered(self) -> list[Resource[Any]]: ...

    def owner_of(self, branch: str) -> Resource[Any] | None: ...

    def in_flight(self, gtrid: str) -> bool: ...

    def failed(self, key: str, error: BaseException | str) -> bool: ...

    def restored(self, gtrid: str, gid: str) -> None: ...


def restore_carried(run: Pass, lasts: list[LastResource]) -> set[str] | None:
    """Hand back every carried branch whose store lost its commit; returns the gtrids whose rows
    must stay (a restore failed, a store is missing or does not ride), or None when a store's
    remembered gids or a last resource's rows could not be read (then no row may go in this
    pass). The rows are read even when no configured store rides: a row that carries a payload
    nobody here can restore must stay, not be deleted as ended.

    The stores' remembered gids are read before the rows: a gid remembered with no row had its
    row deleted before the read (rows go only after the carried record is durable), so it is
    forgotten here; a row whose gid is not remembered was never applied durably, and its payload
    is committed again."""
    riders = [r for r in run.ordered() if rides(r)]
    # every last resource whose rows may hold payloads, even one that may not commit new ones
    # (`carries`): an earlier process's rows must be read, restored and kept, never dropped
    holders = [r for r in lasts if holds(r)]
    if not holders:
        return set()
    remembered: dict[str, set[str]] = {}
    for rider in riders:
        try:
            remembered[rider.name] = rider.carried_gids()
        except Exception as exc:  # cannot tell a lost apply from a done one: keep the rows
            run.failed(f"carried:{rider.name}", exc)
            return None
    rows: dict[str, dict[str, bytes]] = {}
    for holder in holders:
        try:
            rows.update(holder.carried_of(run.node_id))
        except Exception as exc:
            run.failed(f"carried:{getattr(holder, 'name', '?')}", exc)
            return None
    keep: set[str] = set()
    restored_all = True  # every row not in flight restored (or already there)
    for gtrid, carried in sorted(rows.items()):
        if run.in_flight(gtrid):  # its own phase two applies it
            keep.add(gtrid)
            continue
        for name, payload in carried.items():
            if not _restore_one(run, gtrid, name, payload, remembered):
                keep.add(gtrid)
                restored_all = False
    live = {Xid.branch_of(g, n).to_gid() for g, carried in rows.items() for n in carried}
    for rider in riders:
        _forget(run, rider, remembered[rider.name] - live)
    if restored_all:
        for rider in riders:
            _restored(run, rider)
    return keep


def _restored(run: Pass, rider: CarriedBranches) -> None:
    """Tell a store that waits for it (the cursor hands nothing out after a crash until then)
    that this node's rows hold nothing more to restore, for it or for any other store: only a
    pass that restored every row says so (a row naming a store it could not find may be this
    store's under another name)."""
    done = getattr(rider, "carried_restored", None)
    if done is not None:
        done(run.node_id)


def _restore_one(
    run: Pass, gtrid: str, name: str, payload: bytes, remembered: dict[str, set[str]]
) -> bool:
    """One carried branch of a committed row: restored (or already there) -> True."""
    rider = run.owner_of(name)
    xid = Xid.branch_of(gtrid, name)
    if rider is None or not rides(rider):
        why = f"carried branch {name!r} names no configured store that can restore it"
        return run.failed(gtrid, why)
    if xid.to_gid() in remembered.get(rider.name, ()):
        return True
    try:
        rider.restore_carried(xid, payload)
    except Exception as exc:
        return run.failed(xid.to_gid(), exc)
    crash_point("recovery.carried.after_restore")
    run.restored(gtrid, xid.to_gid())
    return True


def forget_carried(run: Pass, dropped: set[str]) -> None:
    """Rows just deleted: their carried branches' stores may stop remembering them."""
    if not dropped:
        return
    for rider in (r for r in run.ordered() if rides(r)):
        _forget(run, rider, {g for g in rider.carried_gids() if Xid.from_gid(g).gtrid in dropped})


def _forget(run: Pass, rider: CarriedBranches, gids: Collection[str]) -> None:
    mine = sorted(g for g in gids if Xid.from_gid(g).belongs_to(run.node_id))
    if mine:
        with contextlib.suppress(Exception):  # housekeeping: the next pass forgets them
            rider.forget_carried(mine)
