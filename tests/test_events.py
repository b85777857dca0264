"""The lifecycle's events: each subscriber is told, in order, and one that fails stops no other.

The daemon's own subscriptions (stats, the memory tier, the mirror, retention) are exercised end to end by the
tests of those features; here is the contract they rest on.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ckptd.core.events import Committed, Events, Failed, SnapshotDropped, SnapshotHeld
from ckptd.protocol.errors import WriteFailed


def test_subscribers_run_in_order_and_only_for_their_event_type() -> None:
    events, told = Events(), []
    events.subscribe(Committed, lambda e: told.append(("first", e.path)))
    events.subscribe(Failed, lambda e: told.append(("failed", e.error.message)))
    events.subscribe(Committed, lambda e: told.append(("second", e.path)))
    events.publish(Committed(Path("/c/a"), 1, 10, 0.5, None))
    events.publish(Failed(Path("/c/b"), WriteFailed("disk full")))
    events.publish(SnapshotHeld(Path("/c/m"), 2, 10))  # nobody listens: nothing happens
    assert told == [("first", Path("/c/a")), ("second", Path("/c/a")), ("failed", "disk full")]


def test_a_subscriber_that_raises_is_logged_and_the_next_one_still_runs(caplog: pytest.LogCaptureFixture) -> None:
    events, told = Events(), []

    def broken(event: SnapshotDropped) -> None:
        raise RuntimeError("a defect in one reaction")

    events.subscribe(SnapshotDropped, broken)
    events.subscribe(SnapshotDropped, lambda e: told.append(e.reason))
    with caplog.at_level(logging.ERROR, logger="ckptd"):
        events.publish(SnapshotDropped(Path("/c/m"), 3, "budget"))
    assert told == ["budget"]
    assert "event=subscriber_failed kind=SnapshotDropped path=/c/m" in caplog.text
    assert "a defect in one reaction" in caplog.text


def test_a_subscriber_that_raises_is_handed_to_the_defect_hook_not_swallowed() -> None:
    """The daemon's hook records it as an internal error (``ckptd status`` shows it); the next subscriber still
    runs."""
    defects: list[BaseException] = []
    events, told = Events(defect=defects.append), []

    def broken(event: Committed) -> None:
        raise KeyError("a defect in one reaction")

    events.subscribe(Committed, broken)
    events.subscribe(Committed, lambda e: told.append(e.path))
    events.publish(Committed(Path("/c/a"), 1, 10, 0.5, None))
    assert told == [Path("/c/a")]
    assert [type(d) for d in defects] == [KeyError]
