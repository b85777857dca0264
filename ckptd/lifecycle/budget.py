"""The node's memory budget (``--memory-budget``): one count of what every tenant of node memory holds, and the one
place that lets go of what nobody asked for before a tenant is refused room.

Three tenants share it: this node's snapshots (``snapshots.SnapshotBook``), the replicas this node holds for its
peers (``peers/replicas.ReplicaBook``), and the spare files of replaced replicas (``peers/spares.py``), which hold
nothing anyone asked for and so are let go first (``make_room``). Each tenant registers how to count itself when it
is built; none asks another (nor the loop that wires them) how much the others hold.

Bookkeeping only, on the loop thread.
"""

from __future__ import annotations

from typing import Callable


class MemoryBudget:
    """``total`` bytes of node memory, and what its tenants hold of it."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._tenants: dict[str, Callable[[], int]] = {}
        self._spares: Callable[[int], int] = lambda needed: 0

    def count(self, tenant: str, held: Callable[[], int]) -> None:
        """Count ``held()`` bytes for ``tenant`` (``snapshots``, ``replicas``) in every total from now on."""
        self._tenants[tenant] = held

    def spare(self, release: Callable[[int], int]) -> None:
        """What ``make_room`` lets go first: ``release(needed)`` frees spare bytes (counted by a tenant) and
        returns how many it freed."""
        self._spares = release

    def held(self, tenant: str | None = None) -> int:
        """Bytes held: by ``tenant``, or by all of them."""
        if tenant is not None:
            return self._tenants[tenant]() if tenant in self._tenants else 0
        return sum(held() for held in self._tenants.values())

    @property
    def free(self) -> int:
        return self.total - self.held()

    def make_room(self, needed: int) -> None:
        """Let go of spare files until ``needed`` more bytes fit, as far as they go (the caller then evicts what
        its own rules allow, or refuses)."""
        if needed > self.free:
            self._spares(needed - self.free)
