"""ckptd: asynchronous, crash-safe checkpoints written by a per-node daemon.

``import ckptd`` gives the whole public API. The torch-side names (``Client``,
``load``, ...) are imported on first use, so the daemon, which imports this
package too, never loads torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from ckptd.protocol import __version__
from ckptd.protocol.errors import *  # noqa: F401,F403
from ckptd.protocol.index import CheckpointIndex, read_index
from ckptd.protocol.inspect import CheckpointInfo, VerifyReport, verify_checkpoint
from ckptd.protocol.inspect import inspect_checkpoint as inspect

_CLIENT_NAMES = ("Client", "SaveFuture", "SaveResult", "load", "load_into", "LoadReport", "latest")
_TORCH_MODULES = ("dcp",)
"""Torch-side submodules of this package (``ckptd/dcp.py``), also reachable as attributes
(``ckptd.dcp.StorageReader`` after a bare ``import ckptd``); imported on first use."""


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        return getattr(importlib.import_module("ckptd.client"), name)
    if name in _TORCH_MODULES:
        return importlib.import_module(f"ckptd.{name}")
    raise AttributeError(f"module 'ckptd' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_CLIENT_NAMES) + list(_TORCH_MODULES))
