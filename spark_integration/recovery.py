"""Recovery of Spark writes: the coordinator's own, configured from the writer's options.

Why nothing Spark-specific is needed here: a Spark branch is a sub-branch of a configured
resource (`coordinator.xid`), so `TransactionManager.recover` finishes a crashed driver's
decision like any other (the decision names the branches), and presumes abort for an undecided
Spark branch once it is older than ``sub_branch_grace`` — which must be the writer's
``log.grace_seconds``, longer than a stage can take from a task's prepare to the driver's
decision. This helper only builds that manager from the same options the writer used, so that
the resource names (the branch owners) are the same. ``twopc recover`` with a config file naming
the same resources, the ledger resource (``spark-ledger`` on the log database) and node works
as well.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from coordinator import TransactionManager
from resource_managers.postgres import SqlDecisionLog

from .connect import open_targets
from .targets import parse_options


@contextmanager
def recovery_manager(
    options: Mapping[str, str], **manager_options: Any
) -> Iterator[TransactionManager]:
    """A manager of the writer's node over its targets and ledger; closed (lease released) on
    exit. No background threads unless asked: call ``recover()``."""
    config = parse_options(options)
    manager_options.setdefault("recover_on_start", False)
    manager_options.setdefault("recovery_interval", None)
    manager_options.setdefault("reaper_interval", None)
    manager_options.setdefault("sub_branch_grace", config.log.grace_seconds)
    with open_targets(config) as opened:
        log = SqlDecisionLog(
            opened.log_engine,
            config.log.node,
            table_prefix=config.log.table_prefix,
            acquire_timeout=config.log.acquire_timeout,
            lease_seconds=config.log.lease_seconds,
        )
        tm = TransactionManager(config.log.node, log, opened.all_resources(), **manager_options)
        try:
            yield tm
        finally:
            tm.close()
