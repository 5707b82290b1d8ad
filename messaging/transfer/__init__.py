"""The transfer protocol between a message log and a cursor (US 8,200,836), numbered as MSMQ's
exactly-once in-order delivery numbers a stream (sequence and previous numbers).

`LogTransfer` runs at the log (embedded, or in ``twopc serve log``) and sends; `TransferReceiver`
is the cursor's handler for connections that authenticated with the ``transfer`` role.
"""

from .receiver import TransferReceiver
from .sender import TRANSFER_ROLE, LogTransfer

__all__ = ["TRANSFER_ROLE", "LogTransfer", "TransferReceiver"]
