"""Soak: the stateful test of ``tests/test_stateful.py`` with many more, random, sequences (``make soak``)."""

from __future__ import annotations

import os

import pytest
from s3server import S3Server

from stateful import run_stateful

pytestmark = pytest.mark.skipif(os.environ.get("CKPTD_SOAK") != "1",
                                reason="soak test: run with `make soak` (CKPTD_SOAK=1)")


@pytest.mark.timeout(3600)
def test_many_random_sequences_keep_every_acknowledged_checkpoint_whole(aws: S3Server) -> None:
    """Random sequences each run (a failure is shrunk to its shortest sequence and printed)."""
    run_stateful(aws, examples=int(os.environ.get("STATEFUL_EXAMPLES", "60")),
                 steps=int(os.environ.get("STATEFUL_STEPS", "20")), derandomize=False,
                 shrink=os.environ.get("STATEFUL_SHRINK", "1") == "1")
