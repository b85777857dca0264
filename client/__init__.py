"""The training-side library: ``Client.save_async`` and ``load``.

Imports as ``ckptd.client``; its public names are re-exported from ``ckptd``.
"""

from ckptd.protocol.index import latest

from .api import Client
from .future import SaveFuture, SaveResult
from .load import load

__all__ = ["Client", "SaveFuture", "SaveResult", "latest", "load"]
