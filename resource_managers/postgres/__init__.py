"""PostgreSQL for twopc: a resource manager (`PostgresResource`) and a decision log stored in
the database (`SqlDecisionLog`) for coordinators that another host must be able to recover."""

from .resource import BranchFailed, NotPreparable, PostgresResource
from .sql_log import SqlDecisionLog

__all__ = ["BranchFailed", "NotPreparable", "PostgresResource", "SqlDecisionLog"]
