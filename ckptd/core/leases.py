"""Load leases: at most N ranks of a node read a checkpoint at once.

Eight ranks each pulling a whole checkpoint into memory at the same moment
can run a node out of CPU memory. A rank that loads with
``max_concurrent_per_node=N`` first asks the daemon for a lease; the daemon
grants leases first come, first served, while fewer than N are held, and
takes a lease back when its holder releases it or its process dies.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class _Waiter:
    client: bytes
    request_id: int
    pid: int
    limit: int | None
    since: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Grant:
    client: bytes
    request_id: int
    waited: float


class LoadLeases:
    """FIFO lease queue; every method returns the grants it made possible."""

    def __init__(self, default_limit: int | None) -> None:
        self.default_limit = default_limit
        self.queue: deque[_Waiter] = deque()
        self.holders: dict[bytes, _Waiter] = {}

    def request(self, client: bytes, request_id: int, pid: int, limit: int | None) -> list[Grant]:
        self.release(client)  # one lease per client connection
        self.queue.append(_Waiter(client, request_id, pid, limit))
        return self._grant()

    def release(self, client: bytes) -> list[Grant]:
        self.holders.pop(client, None)
        return self._grant()

    def drop_client(self, client: bytes) -> list[Grant]:
        """The client is gone (Bye or death): its lease and queued requests go too."""
        self.queue = deque(w for w in self.queue if w.client != client)
        return self.release(client)

    def _grant(self) -> list[Grant]:
        grants = []
        while self.queue:
            head = self.queue[0]
            limit = head.limit or self.default_limit
            if limit is not None and len(self.holders) >= limit:
                break
            self.queue.popleft()
            self.holders[head.client] = head
            grants.append(Grant(head.client, head.request_id, time.monotonic() - head.since))
        return grants

    def status(self) -> dict:
        now = time.monotonic()
        return {
            "default_limit": self.default_limit,
            "held": [{"pid": h.pid} for h in self.holders.values()],
            "waiting": [{"pid": w.pid, "waited_s": round(now - w.since, 3)} for w in self.queue],
        }
