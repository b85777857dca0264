"""Placement: which node holds this node's replicas (its buddy), and whom it asks for them back.

Two ways to place, and the static one wins where given:

- **Static** (``--peer``, repeatable, with ``--peer-keys FILE``): the first
  ``--peer`` is the buddy, for a daemon that must know it before any job runs.
- **By the ranks** (``--peer-listen`` alone): when a job's clients start under
  torch.distributed, its ranks agree on the node map over a gloo group of their
  own, and each node's first rank sends its daemon the ``Ring``
  (``client/coordinate.py``): the nodes with a peer endpoint in order of their
  lowest global rank, with their keys. Node i's buddy is node i + 1, the last
  node's is node 0, and the ring's keys are trusted (``keys.Trust``).

A ring is taken only from a client that said hello as a rank of the run the
ring names, on the daemon's own socket (ipc, in its 0700 run directory): a peer
cannot send one, and its checks at decode refuse a malformed one. Each new ring
replaces the one before, so a job restarted with a replacement node (a new
key, perhaps a new endpoint) moves every survivor's trust and buddy to it.

A node restoring asks its static peers, in ``--peer`` order, then its ring
buddy: the one node that holds its replicas under ring placement.

Links (``link.PeerLink``) are made on demand, one per endpoint and use: the
streams' run on the ``peer`` pool, the questions' on ``peer_ask``. A link the
placement no longer names is closed on its own pool, after whatever was queued
there for it.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

import zmq

from ckptd.protocol.errors import BadMessage
from ckptd.protocol.messages import Ring

from ckptd.core.config import DaemonConfig
from ckptd.core.keys import KeyPair, Trust
from ckptd.core.workers import Workers
from ckptd.peers.link import PeerLink

log = logging.getLogger("ckptd")
WILDCARDS = frozenset({"*", "0.0.0.0", "[::]", "::"})
"""``--peer-listen`` hosts that bind every address: not one a peer can connect to."""


def advertised(listen: str) -> str:
    """The endpoint peers reach ``listen`` at: a wildcard host is replaced by this host's name."""
    host, _, port = listen.removeprefix("tcp://").rpartition(":")
    return f"tcp://{socket.getfqdn()}:{port}" if host in WILDCARDS else listen


@dataclass(frozen=True)
class RingPlace:
    """This daemon's place in the ring its ranks sent."""

    job: str
    node: int
    endpoints: tuple[str, ...]

    @property
    def buddy(self) -> str:
        return self.endpoints[(self.node + 1) % len(self.endpoints)]


class Placement:
    """The buddy and the peers to ask, from ``--peer`` and the ring."""

    def __init__(self, ctx: zmq.Context, config: DaemonConfig, trust: Trust, workers: Workers,
                 stream_timeout: float, ask_timeout: float) -> None:
        self.ctx, self.config, self.trust, self.workers = ctx, config, trust, workers
        self.pair = KeyPair.of(config.run_dir)
        self.endpoint = advertised(config.peer_listen) if config.peer_listen is not None else None
        self.ring: RingPlace | None = None
        self._timeouts = {"peer": stream_timeout, "peer_ask": ask_timeout}
        self._links: dict[str, dict[str, PeerLink]] = {"peer": {}, "peer_ask": {}}

    def identity(self) -> tuple[str, str]:
        """(public key, endpoint) as this daemon's ranks tell the job's others; empty without a peer endpoint."""
        if self.endpoint is None:
            return "", ""
        return self.pair.public.decode(), self.endpoint

    def take(self, msg: Ring, job: str, world_size: int) -> None:
        """Take the ring a client sent, if that client is a rank of its run and it places this daemon where this
        daemon is (BadMessage saying what is wrong otherwise). ``job``/``world_size``: the sender's hello."""
        if not job or job != msg.job or world_size < 2:
            raise BadMessage(f"a ring comes from a rank of the run it names ({msg.job!r}); this client said hello "
                             f"as {'rank of run ' + repr(job) if job else 'no named run'} of world size {world_size}")
        key, endpoint = self.identity()
        if (msg.keys[msg.node], msg.endpoints[msg.node]) != (key, endpoint):
            raise BadMessage(f"the ring places node {msg.node} at {msg.endpoints[msg.node]} with key "
                             f"{msg.keys[msg.node]}, but this daemon is {endpoint or 'no peer endpoint'} with key "
                             f"{key or 'none'}")
        before = self.ring
        self.ring = RingPlace(msg.job, msg.node, msg.endpoints)
        self.trust.set_ring(msg.endpoints, msg.keys)
        self._retire()
        static = f" static_buddy={self.config.peers[0]}" if self.config.peers else ""
        log.info("event=ring_set job=%s node=%d nodes=%d buddy=%s%s replaced=%s", msg.job, msg.node,
                 len(msg.endpoints), self.ring.buddy, static, "none" if before is None else before.job)

    def buddy_endpoint(self) -> str | None:
        """Where this node's snapshots are replicated: the first ``--peer``, else the ring's next node; None
        with ``--replicas 0`` or neither."""
        if not self.config.replicas:
            return None
        if self.config.peers:
            return self.config.peers[0]
        return None if self.ring is None else self.ring.buddy

    def ask_endpoints(self) -> list[str]:
        """The peers a node restoring asks, in order: ``--peer``'s, then the ring's buddy."""
        endpoints = list(self.config.peers)
        if self.ring is not None and self.ring.buddy not in endpoints:
            endpoints.append(self.ring.buddy)
        return endpoints

    def buddy(self) -> PeerLink | None:
        endpoint = self.buddy_endpoint()
        return None if endpoint is None else self._link("peer", endpoint)

    def asks(self) -> list[PeerLink]:
        return [self._link("peer_ask", endpoint) for endpoint in self.ask_endpoints()]

    def _link(self, pool: str, endpoint: str) -> PeerLink:
        links = self._links[pool]
        if endpoint not in links:
            links[endpoint] = PeerLink(self.ctx, endpoint, self.trust, self.pair, self._timeouts[pool],
                                       encrypt=self.config.peer_encrypt)
        return links[endpoint]

    def _retire(self) -> None:
        """Close, each on its own pool, the links to endpoints the placement no longer names."""
        named = {"peer": {self.buddy_endpoint()}, "peer_ask": set(self.ask_endpoints())}
        for pool, links in self._links.items():
            for endpoint in [ep for ep in links if ep not in named[pool]]:
                self.workers.background(pool, links.pop(endpoint).close)

    def close(self) -> None:
        """Close every link (the pools have stopped)."""
        for links in self._links.values():
            for link in links.values():
                link.close()
            links.clear()
