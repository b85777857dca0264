"""``ckptd.dcp``: the torch.distributed.checkpoint reader and writer, importable by their public name.

``import ckptd.dcp`` and ``from ckptd.dcp import StorageReader, StorageWriter``
work like any module. Both live with the rest of the torch-side code
(``client/dcp.py``, ``client/dcp_writer.py``); this module only names them
here, and only a caller that imports it loads torch: the daemon never does.
"""

from __future__ import annotations

from ckptd.client.dcp import StorageReader
from ckptd.client.dcp_writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter"]
