"""Soak: the fuzzing of ``tests/test_fuzz_daemon.py`` at 20,000 requests (``make soak``)."""

from __future__ import annotations

import os

import pytest

from fuzzing import run_fuzz

pytestmark = pytest.mark.skipif(os.environ.get("CKPTD_SOAK") != "1",
                                reason="soak test: run with `make soak` (CKPTD_SOAK=1)")


@pytest.mark.timeout(3600)
def test_twenty_thousand_adversarial_requests_each_get_one_error_while_a_client_saves_throughout(
    daemon, client_factory, root, tmp_path
) -> None:
    examples = int(os.environ.get("FUZZ_EXAMPLES", "20000"))
    counts = run_fuzz(daemon, client_factory, root, tmp_path, examples=examples, derandomize=False)
    assert counts["requests"] == examples
