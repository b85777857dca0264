"""Adapters that let training frameworks save through ckptd.

Each integration lives in its own module and imports its framework only when
that module is imported (``from ckptd.integrations.lightning import
CkptdCheckpointIO``), so ``import ckptd`` and the daemon never pay for, or
depend on, a framework they do not use. This package itself imports nothing.
"""
