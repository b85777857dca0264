"""``ckptd.dcp``: the torch.distributed.checkpoint reader, importable by its public name.

``import ckptd.dcp`` and ``from ckptd.dcp import StorageReader`` work like
any module. The reader itself lives with the rest of the torch-side code
(``client/dcp.py``); this module only names it here, and only a caller that
imports it loads torch: the daemon never does.
"""

from __future__ import annotations

from ckptd.client.dcp import StorageReader
from ckptd.client.dcp_writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter"]
