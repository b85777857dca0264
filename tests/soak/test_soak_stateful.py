"""Soak: the stateful test of ``tests/test_stateful.py``, every configuration, many more random sequences.

``make soak`` runs ``STATEFUL_EXAMPLES`` sequences of up to ``STATEFUL_STEPS``
steps per configuration (default 30 x 20, fewer where ``DEFAULTS`` says;
``STATEFUL_CONFIGS``: a comma-separated subset); a
failure is shrunk to its shortest sequence and printed.
"""

from __future__ import annotations

import os

import pytest
from s3server import S3Server

from stateful import run_stateful
from stateful_world import CONFIGS

pytestmark = pytest.mark.skipif(os.environ.get("CKPTD_SOAK") != "1",
                                reason="soak test: run with `make soak` (CKPTD_SOAK=1)")

CHOSEN = [c for c in os.environ.get("STATEFUL_CONFIGS", ",".join(CONFIGS)).split(",") if c]
DEFAULTS = {"node_lost": (20, 15), "node_lost_wide": (10, 15), "one_model": (20, 20)}
"""(sequences, steps) where the defaults of 30 x 20 would outlast the hour: every step of these starts a job of
three nodes (a node loss also a daemon and a key pair), 5-10 s each on two busy cores; ``one_model`` waits for
replication to settle after every step and loses a node in every sequence."""


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("config", CHOSEN)
def test_many_random_sequences_keep_every_acknowledged_checkpoint_whole(aws: S3Server, config: str) -> None:
    """Random sequences of one configuration (``stateful_world.CONFIGS``)."""
    examples, steps = DEFAULTS.get(config, (30, 20))
    print(run_stateful(aws, config, examples=int(os.environ.get("STATEFUL_EXAMPLES", examples)),
                       steps=int(os.environ.get("STATEFUL_STEPS", steps)), derandomize=False,
                       shrink=os.environ.get("STATEFUL_SHRINK", "1") == "1"))
