"""The stateful test, short run: random sequences of saves of every tier, crashes and outages against a model.

The machine and its invariants are in ``tests/stateful.py``; ``make soak`` runs
many more examples (``tests/soak/test_soak_stateful.py``). This run is
derandomized, so it is the same sequence every time and cannot flake.
"""

from __future__ import annotations

import os

import pytest
from s3server import S3Server

from stateful import run_stateful


@pytest.mark.timeout(600)
def test_random_saves_crashes_and_outages_keep_every_acknowledged_checkpoint_whole(aws: S3Server) -> None:
    run_stateful(aws, examples=int(os.environ.get("STATEFUL_EXAMPLES", "6")),
                 steps=int(os.environ.get("STATEFUL_STEPS", "12")), derandomize=True,
                 shrink=os.environ.get("STATEFUL_SHRINK") == "1")
