"""The transfer protocol between a message log and a cursor (seed 000 over seed 004's numbers).

`LogTransfer` runs at the log (embedded, or in ``twopc serve log``) and sends; `TransferReceiver`
is the cursor's handler for connections that authenticated with the ``transfer`` role.
"""

from .receiver import TransferReceiver
from .sender import TRANSFER_ROLE, LogTransfer

__all__ = ["TRANSFER_ROLE", "LogTransfer", "TransferReceiver"]
