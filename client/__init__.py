"""The training-side library: ``Client.save_async`` and ``load``.

Imports as ``ckptd.client``; its public names are re-exported from ``ckptd``.
"""

from .api import Client
from .future import SaveFuture, SaveResult
from .load import load
from .memory import latest
from .restore import LoadReport, load_into

__all__ = ["Client", "LoadReport", "SaveFuture", "SaveResult", "latest", "load", "load_into"]
