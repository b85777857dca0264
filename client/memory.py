"""Reading memory snapshots: what the node's daemon holds, the newest checkpoint, and its bytes.

The daemon keeps each snapshot's shards in the slots its clients staged them
in (``ListSnapshots`` lists them: path, step, ranks, slot names, checksums). A
reader reads a held slot into its own memory (no disk, memcpy speed) and
checks those bytes against the checksum the daemon computed when it took the
slot over; tensors view or copy only checked bytes. A snapshot the daemon
drops while it is being read fails that check, and the reader falls back to
disk when the checkpoint is there too, or says the snapshot was dropped.

``latest`` merges disk and memory: the newest committed checkpoint or complete
snapshot. With torch.distributed initialized every rank asks its own daemon,
and the ranks agree (msgpack over a gloo group, ``coordinate``): a snapshot
that any rank's daemon lacks is never chosen.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ckptd.protocol.checksums import Behind
from ckptd.protocol.chunks import tensor_table
from ckptd.protocol.endpoint import default_run_dir, endpoint_for
from ckptd.protocol.errors import BadMessage, CkptdError, DaemonUnavailable, InvalidCheckpoint
from ckptd.protocol.index import CheckpointIndex, ShardRecord, read_index
from ckptd.protocol.index import latest as latest_on_disk
from ckptd.protocol.objects import canonical, resolved, user_path
from ckptd.protocol.layout import MAX_HEADER_BYTES, TensorEntry, parse_header
from ckptd.protocol.mapped import GAP_READ, MappedShard, identity
from ckptd.protocol.messages import (
    Bye, Error, Ok, ListPeerSnapshots, Pin, ReplicationState, Restore, SnapshotList, ListSnapshots, Unpin,
)
from ckptd.protocol.reading import files_for
from ckptd.protocol.request import request
from ckptd.protocol.shard_reads import check_checksum
from ckptd.protocol.shm import shm_dir

from .checks import check_path
from .connection import Connection
from .dtypes import typed_view
from .reshard import ChunkFiles, bytes_of, map_shard

R = ReplicationState

log = logging.getLogger("ckptd")
ASK_TIMEOUT = 5.0
"""Seconds to wait for the daemon's list of snapshots (it answers from memory)."""
PEERS_TIMEOUT = 15.0
"""Seconds to wait for the list with its peers' replicas (each peer has a few seconds to answer)."""
RESTORE_TIMEOUT = 600.0
"""Seconds a restore from a peer's replica may take (its bytes cross the network)."""
REPLICATION_POLL_S = 0.02
PARALLEL_COPY = 4 << 20
"""Bytes from which a piece of a held slot is copied by torch (on every core); a smaller piece (one small tensor)
by one memcpy: torch's copy hands each piece to its threads, which cost several times the copy for a small tensor
(five times a memcpy for 256 KiB tensors on a busy two-core machine)."""


def _endpoint(run_dir: str | os.PathLike | None) -> str:
    return endpoint_for(Path(run_dir).absolute()) if run_dir is not None else endpoint_for()


def held_snapshots(run_dir: str | os.PathLike | None = None, *, peers: bool = False) -> list[dict[str, Any]]:
    """The complete snapshots this node's daemon holds (none if no daemon runs); with ``peers``, also the
    replicas its peers hold of snapshots it does not (``on_peer`` names the peer)."""
    return _listed(run_dir, peers=peers) or []


def _listed(run_dir: str | os.PathLike | None, *, peers: bool) -> list[dict[str, Any]] | None:
    """``held_snapshots``, or None where no daemon answers at ``run_dir`` (``latest`` says so)."""
    try:
        reply = request(_endpoint(run_dir), ListPeerSnapshots(1) if peers else ListSnapshots(1),
                        timeout=PEERS_TIMEOUT if peers else ASK_TIMEOUT)
    except DaemonUnavailable:
        return None
    if not isinstance(reply, SnapshotList):  # a daemon that predates snapshots (or peers) answers with an error
        return held_snapshots(run_dir) if peers else []
    for unanswered in reply.unanswered:  # what it holds may be this node's only copy: never silently passed over
        log.warning("ckptd: %s; the replicas it may hold of this node's snapshots were not looked at", unanswered)
    return [s for s in reply.snapshots if s.get("complete")]


def wait_replicated(endpoint: str, path: Path | str, timeout: float | None) -> None:
    """Until the daemon at ``endpoint`` says snapshot ``path`` is replicated (``SaveFuture.wait_replicated``)."""
    want, deadline = resolved(path), None if timeout is None else time.monotonic() + timeout
    while True:
        reply = request(endpoint, ListSnapshots(1), timeout=ASK_TIMEOUT)
        if not isinstance(reply, SnapshotList):
            raise InvalidCheckpoint(f"snapshot {path}: the daemon did not list its snapshots ({reply.type})")
        snap = next((s for s in reply.snapshots if resolved(s["path"]) == want), None)
        try:
            state = None if snap is None else ReplicationState(snap.get("replication", R.OFF))
        except ValueError:  # a daemon of another release names a state this client does not know
            raise InvalidCheckpoint(f"snapshot {path}: the daemon says its replication is "
                                    f"{snap.get('replication')!r}, which this client does not know") from None
        if state in (R.REPLICATED, R.RESTORED):
            return
        if snap is None:  # it may have been replicated before: only that nothing of it is kept now is certain
            raise InvalidCheckpoint(f"snapshot {path} is no longer held (a newer snapshot, a delete or a disk save "
                                    f"dropped it), and its node keeps no copy of it on the buddy")
        if state is R.SUPERSEDED:
            raise InvalidCheckpoint(f"snapshot {path} has no copy of its own on the buddy: a newer snapshot of its "
                                    f"directory was held before its turn, or took its place on the buddy (which "
                                    f"keeps one replica per directory), and is replicated instead")
        if state is not R.REPLICATING:
            why = {R.OFF: "the daemon has no buddy (start it with --peer-listen, so the ranks place it in their "
                          "ring, or with --peer and --peer-keys)"}.get(state, snap.get("replication_error", ""))
            raise InvalidCheckpoint(f"snapshot {path} was not replicated: {why}")
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"snapshot {path} was not replicated within {timeout:g} s (still streaming)")
        time.sleep(REPLICATION_POLL_S)


def restore_from_peer(path: str, run_dir: str | os.PathLike | None = None) -> bool:
    """Ask this node's daemon to read snapshot ``path`` back from a peer's replica (checked end to end); whether
    it is held here now. Why not is logged: a replica that fails its check is never loaded."""
    try:
        reply = request(_endpoint(run_dir), Restore(1, path, rank=_my_rank()), timeout=RESTORE_TIMEOUT)
    except CkptdError as exc:
        reply = Error.of(1, exc)
    if not isinstance(reply, Ok):
        log.warning("ckptd: snapshot %s is not restored from a peer: %s", path, getattr(reply, "message", reply.type))
    return isinstance(reply, Ok)


def _asked(run_dir: str | os.PathLike | None) -> str:
    """The daemon a read asked for memory snapshots, as an error names it: its run directory (``run_dir``, else
    the default a ``Client`` without one uses, never a live ``Client``'s own), and whether any daemon answers
    there, so a snapshot held by a daemon of another run directory is not taken for a lost one."""
    where = Path(run_dir).absolute() if run_dir is not None else default_run_dir()
    try:
        request(_endpoint(run_dir), ListSnapshots(1), timeout=ASK_TIMEOUT)
    except DaemonUnavailable:
        return f"any daemon (none answers at run directory {where}; pass run_dir= to name another)"
    except (CkptdError, TimeoutError):  # one answers, late or with an error: it is the one asked
        pass
    return f"the daemon of run directory {where} (pass run_dir= to ask another)"


def find_held(path: Path, run_dir: str | os.PathLike | None = None) -> dict[str, Any] | None:
    want = resolved(path)
    return next((s for s in held_snapshots(run_dir) if resolved(s["path"]) == want), None)


class HeldFiles(ChunkFiles):
    """A held snapshot's shards, read from the daemon's slots instead of files.

    The index is built from the daemon's list and the slots' own headers,
    so everything that reads a committed checkpoint (``load``, ``load_into``,
    resharding) reads a snapshot the same way.

    The slots stay shared with the daemon, which may drop the snapshot and
    hand a slot back to its trainer, who stages the next step into it while
    this reads. So each shard is read once into this process's own memory
    and checksummed there (``load``: straight into one tensor per saved
    tensor, each owning exactly its bytes, as from disk): the bytes every
    tensor holds or views are the bytes that passed the check, and a shard
    that changed during the read fails it. That is then told as what it is,
    a snapshot dropped while read; if it was persisted, the disk copy is
    read instead.
    """

    remembers_verified = False  # a slot is rewritten in place when its trainer reuses it

    def __init__(self, path: Path, held: dict[str, Any], *, verify: bool, defer: bool = False,
                 run_dir: str | os.PathLike | None = None, lease: "ReaderLease | None" = None) -> None:
        self.path, self.run_dir, self.lease = path, run_dir, lease
        self.direct = defer and lease is not None
        """Copies go straight from the pinned slots into the targets (``load_into``), checksummed as they go."""
        self._copies: dict[str, torch.Tensor] = {}
        self.slots = {name: (rank, size, crc) for rank, name, size, crc, _ in held["shards"]}
        files = tuple(ShardRecord(name, rank, size, crc, tensors) for rank, name, size, crc, tensors in held["shards"])
        self._headers = {f.file: self._header(f) for f in files}
        try:
            tensors = tensor_table([(f.file, f.size, *self._headers[f.file]) for f in files])
        except ValueError as exc:
            raise InvalidCheckpoint(f"snapshot {path} cannot be read from memory: {exc}") from None
        index = CheckpointIndex(world_size=held["world_size"], step=held["step"], created=held["created"],
                                files=files, tensors=tensors, checksum_algorithm=held["checksum_algorithm"])
        super().__init__(path, index, verify=verify, defer=defer)

    def source(self, file: str) -> Path:
        return shm_dir() / file

    def header(self, record: ShardRecord) -> tuple[list[TensorEntry], dict[str, str], int]:
        return self._headers[record.file]

    def __reduce__(self) -> tuple[Any, ...]:
        """Sent to another rank (DCP broadcasts its reader's metadata): that rank opens the snapshot itself, from
        its own daemon and under a lease of its own (a lease is one process's)."""
        return (_reopened, (self.path, self.verify, self.defer, self.run_dir))

    def close(self) -> None:
        if self.lease is not None:
            self.lease.close()

    def _header(self, f: ShardRecord) -> tuple[list[TensorEntry], dict[str, str], int]:
        try:
            with open(shm_dir() / f.file, "rb", buffering=0) as slot:
                prefix = os.pread(slot.fileno(), 8, 0)
                hlen = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
                prefix += os.pread(slot.fileno(), max(0, min(hlen, f.size - 8, MAX_HEADER_BYTES)), 8)
        except OSError as exc:
            raise InvalidCheckpoint(f"snapshot {self.path}: its slot {f.file} is gone ({exc})") from None
        try:
            return parse_header(prefix, f.size)
        except BadMessage as exc:
            raise InvalidCheckpoint(f"snapshot {self.path}, rank {f.rank}: bad header in memory: {exc}") from None

    def mapped(self, file: str) -> torch.Tensor:
        """The held shard's bytes: the pinned slot itself (``direct``: ``copy`` checksums what it copies out),
        else read into this process's memory and checksummed there, once."""
        return self._slot(file) if self.direct else self._owned(file)

    def _slot(self, file: str) -> torch.Tensor:
        """The pinned slot, mapped read-only; its checksum is left for ``copy`` (``ChunkFiles``' deferred files)."""
        if file not in self._maps:
            rank, size, _ = self.slots[file]
            try:
                with open(self.source(file), "rb", buffering=0) as slot:
                    if os.fstat(slot.fileno()).st_size < size:
                        raise InvalidCheckpoint(f"snapshot {self.path}: its slot {file} is shorter than its shard")
                    mapping = mmap.mmap(slot.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ)
                    ident = identity(slot.fileno())
            except (OSError, ValueError) as exc:
                raise InvalidCheckpoint(f"snapshot {self.path}: its slot {file} is gone ({exc})") from None
            record = self.index.shard(rank)
            shard = MappedShard(self.source(file), record, self.index.checksum_algorithm, mapped=(mapping, ident))
            self._opened(file, shard, record, check=self.verify)
        return self._maps[file]

    def _owned(self, file: str) -> torch.Tensor:
        """The held shard's bytes, read into this process's memory and checksummed there, once."""
        if file not in self._copies:
            rank, size, _ = self.slots[file]
            record = self.index.shard(rank)
            data = torch.empty(size, dtype=torch.uint8)
            try:
                self._read_checked(record, [data])
            except InvalidCheckpoint as exc:
                data = self._instead_of_dropped(record, exc)
            self._copies[file] = data
        return self._copies[file]

    def _tensors_owned(self, record: ShardRecord) -> dict[str, torch.Tensor]:
        """Each tensor of the shard in memory of its own (its storage exactly its bytes, as from disk): a tensor
        viewing the shard's one buffer kept all of it alive, ``torch.save`` of it wrote all of it, and torch reads
        a generator's state from its storage's start (``torch.set_rng_state`` died of it).

        Read straight from the slot into each tensor, checksummed as it goes; a shard this reader holds whole
        already (its global tensors' chunks are read from it) has its tensors copied out of that, once checked.
        """
        entries, _, data_start = self._headers[record.file]
        entries = sorted(entries, key=lambda e: e.begin)  # file order: back to back, no holes (``parse_header``)
        if record.file not in self._copies and not self.holds_chunks(record.file):
            bufs = [torch.empty(e.nbytes, dtype=torch.uint8) for e in entries]
            try:
                self._read_checked(record, [torch.empty(data_start, dtype=torch.uint8), *bufs])
                return {e.name: typed_view(buf, e) for e, buf in zip(entries, bufs)}
            except InvalidCheckpoint as exc:
                self._copies[record.file] = self._instead_of_dropped(record, exc)
        data = self._owned(record.file)
        return {e.name: typed_view(data[data_start + e.begin : data_start + e.end].clone(), e) for e in entries}

    def _read_checked(self, record: ShardRecord, into: list[torch.Tensor]) -> None:
        """Read the slot into ``into`` (byte buffers that cover the shard front to back: the header, then each
        tensor in file order) and check the bytes read: their checksum (``verify``), and their header, which must
        still be the one this reader parsed. ``InvalidCheckpoint`` if not."""
        rank = record.rank
        crc = self._read_slot(record, into)
        if crc is not None:
            check_checksum(self.path / f"rank {rank} in memory", crc, record, self.index.checksum_algorithm)
        if parse_header(bytes_of(into[0]), record.size) != self._headers[record.file]:  # unverified: same layout?
            raise InvalidCheckpoint(f"snapshot {self.path}: the header of rank {rank} changed while read")

    def _read_slot(self, record: ShardRecord, into: list[torch.Tensor]) -> int | None:
        """Copy the slot into ``into`` (byte buffers, front to back) in large pieces, each checksummed right behind
        its copy (``verify``).

        The copy goes through a shared read-only mapping (torch's copy runs
        on every core; a ``preadv`` from shared memory copies page by page on
        one, at about half the speed), and the checksum is of the copied
        bytes, so what the caller gets is what was checked however the slot
        changes meanwhile. The slot's size is checked first: nothing but a
        foreign process truncates a held slot (whose mapping would then fault).
        """
        try:
            with open(shm_dir() / record.file, "rb", buffering=0) as slot:
                if os.fstat(slot.fileno()).st_size < record.size:
                    raise InvalidCheckpoint(f"snapshot {self.path}: its slot {record.file} is shorter than its shard")
                mapping = mmap.mmap(slot.fileno(), record.size, mmap.MAP_SHARED, mmap.PROT_READ)
        except (OSError, ValueError) as exc:
            raise InvalidCheckpoint(f"snapshot {self.path}: its slot {record.file} is gone ({exc})") from None
        source = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only: only ever copied from
                source = torch.frombuffer(mapping, dtype=torch.uint8)
            with Behind(self.index.checksum_algorithm) as crc, memoryview(mapping) as view:
                start = 0
                for target in into:
                    for offset in range(0, target.numel(), GAP_READ):
                        piece, begin = target[offset : offset + GAP_READ], start + offset
                        if piece.numel() >= PARALLEL_COPY:
                            piece.copy_(source[begin : begin + piece.numel()])
                        else:
                            bytes_of(piece)[:] = view[begin : begin + piece.numel()]
                        if self.verify:
                            crc.add(bytes_of(piece))
                    start += target.numel()
                return crc.value() if self.verify else None
        finally:
            del source
            mapping.close()

    def _instead_of_dropped(self, record: ShardRecord, exc: InvalidCheckpoint) -> torch.Tensor:
        """A shard that failed its read: the daemon's disk copy of it when the snapshot was dropped after being
        persisted, else an error that says whether the snapshot was dropped while it was read."""
        still = find_held(self.path, self.run_dir)
        same = [record.rank, record.file, record.size, record.checksum]
        if still is not None and same in [s[:4] for s in still["shards"]]:
            raise exc  # still held, yet wrong: damaged memory, not a drop
        try:
            on_disk = read_index(self.path)
            disk = on_disk.shard(record.rank)
        except (InvalidCheckpoint, KeyError, IndexError):
            raise InvalidCheckpoint(
                f"memory snapshot {self.path} was dropped by the daemon while rank {record.rank} was being read "
                f"(a newer snapshot took its memory: --keep-snapshots), and it is not on disk; nothing was loaded. "
                f"Load the newer one (ckptd.latest), or persist snapshots that must stay readable") from None
        if (disk.checksum, on_disk.checksum_algorithm) != (record.checksum, self.index.checksum_algorithm):
            raise InvalidCheckpoint(f"memory snapshot {self.path} was dropped while rank {record.rank} was being "
                                    f"read, and the checkpoint on disk under that path holds other bytes") from None
        shard = map_shard(self.path / disk.file, disk, verify=True, algorithm=on_disk.checksum_algorithm)
        self._shards[record.file] = shard  # held open while the tensors handed out view it
        return torch.frombuffer(shard.mapping, dtype=torch.uint8)

    def read(self, record: ShardRecord, *, copy: bool) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
        """One rank's tensors: with ``copy`` each in memory of its own (``_tensors_owned``); else views of its
        verified bytes in this process's own memory, or (``direct``) of the pinned slot, for ``load_into`` to copy
        out of while the lease holds."""
        entries, metadata, data_start = self._headers[record.file]
        if copy:
            return metadata, self._tensors_owned(record)
        data = self._slot(record.file) if self.direct else self._owned(record.file)
        return metadata, {e.name: typed_view(data[data_start + e.begin : data_start + e.end], e) for e in entries}


class ReaderLease:
    """A reader's pin on a held snapshot (``Pin``): until ``close`` the daemon keeps its slots as they are (a drop
    waits for it), so ``load_into`` copies straight out of them. ``held`` is the snapshot as the daemon lists it
    now, None if it holds it no more. The daemon ends the pins of a reader that says goodbye or dies."""

    def __init__(self, path: Path, run_dir: str | os.PathLike | None = None) -> None:
        endpoint = endpoint_for(Path(run_dir).absolute()) if run_dir is not None else endpoint_for()
        self.path = resolved(path)
        self._conn = Connection(endpoint, heartbeat=1.0, timeout=ASK_TIMEOUT)
        try:
            self._conn.introduce()
            reply = self._conn.call(Pin(self._conn.next_id(), self.path))
        except BaseException:
            self._conn.close()
            raise
        self.held: dict[str, Any] | None = next(iter(reply.snapshots), None)

    def close(self) -> None:
        try:
            if self.held is not None:
                self._conn.call(Unpin(self._conn.next_id(), self.path))
            self._conn.call(Bye(self._conn.next_id()))
        except (CkptdError, TimeoutError):  # the daemon is gone: so are its pins
            pass
        finally:
            self._conn.close()


def _pinned(path: Path, run_dir: str | os.PathLike | None) -> ReaderLease | None:
    """A lease on the snapshot at ``path``; None from a daemon that predates pins (it refuses the request) or that
    stopped answering since it listed the snapshot."""
    try:
        return ReaderLease(path, run_dir)
    except (BadMessage, DaemonUnavailable, TimeoutError):  # gone or too old: read unpinned, which notices a drop
        return None


def _reopened(path: Path, verify: bool, defer: bool, run_dir: str | os.PathLike | None) -> ChunkFiles:
    return open_checkpoint(path, verify=verify, run_dir=run_dir, defer=defer)


def open_checkpoint(path: Path, *, verify: bool, run_dir: str | os.PathLike | None = None,
                    defer: bool = False) -> ChunkFiles:
    """The checkpoint's files: from the daemon's memory when it holds ``path``, else from disk.

    A held snapshot is pinned while it is read (``close`` ends the lease), and with ``defer`` (``load_into``)
    copied straight out of its slots into the targets, checksummed in the same pass.
    """
    held, lease = find_held(path, run_dir), None
    if held is not None and (lease := _pinned(path, run_dir)) is not None:
        held = lease.held
        if held is None:  # dropped since it was listed
            lease.close()
    if held is not None:
        try:
            return HeldFiles(path, held, verify=verify, defer=defer, run_dir=run_dir, lease=lease)
        except InvalidCheckpoint as exc:
            if lease is not None:
                lease.close()
            if not path.exists():
                raise InvalidCheckpoint(f"memory snapshot {path} was dropped by the daemon as it was opened, and it "
                                        f"is not on disk: {exc}") from None
        except BaseException:
            if lease is not None:
                lease.close()
            raise
    try:
        index = read_index(path)
    except InvalidCheckpoint as exc:
        if files_for(path).unanswered_is_error or path.exists():  # on a store, a failed read never means "nothing there"
            raise
        raise InvalidCheckpoint(f"{exc}; nor does {_asked(run_dir)} hold a memory snapshot of it (one taken there "
                                f"is gone if --keep-snapshots newer ones of its job are held, or the daemon "
                                f"restarted)") from None
    return ChunkFiles(path, index, verify=verify, defer=defer)


def latest(root: str | os.PathLike, *, run_dir: str | os.PathLike | None = None) -> Path | str | None:
    """The newest checkpoint under ``root``: committed on disk, or a complete snapshot in node memory.

    Newest means the highest step, then the most recent; of one path, its
    version written last counts (a snapshot saved over a disk checkpoint
    with ``overwrite=True`` at a lower step, a rollback, is that path). With
    torch.distributed initialized (several ranks) every rank must call it:
    the ranks agree, and a snapshot that some rank's daemon does not hold is
    never chosen (that rank could not restore it), nor a disk checkpoint some
    rank cannot see. A snapshot this node lost that a peer holds a replica of
    counts as held here: the ranks agree first, then the ranks that need it
    read the chosen one back, so no replica is read that the others cannot
    match.
    """
    if run_dir is not None:
        check_path("run_dir", run_dir)
    on_disk = latest_on_disk(root)  # checks root, too
    root, here, saves = Path(root), {}, {}
    if on_disk is not None:
        try:
            index = read_index(on_disk)
            here[str(on_disk)] = (index.step if index.step is not None else -1, index.created)
        except InvalidCheckpoint:  # removed since
            pass
    real_root, there, other_world = canonical(root), {}, []
    listed = _listed(run_dir, peers=True)
    if listed is None:  # None must still mean "nothing to resume from": the why is logged, not raised
        log.warning("ckptd.latest: no daemon answers at run directory %s, so only checkpoints on disk under %s "
                    "were considered, not memory snapshots (pass run_dir= to ask another daemon)",
                    Path(run_dir).absolute() if run_dir is not None else default_run_dir(), root)
    for s in listed or ():
        parent, name = os.path.split(resolved(s["path"]))
        if parent != real_root:
            continue
        key, shown = (s["step"] if s["step"] is not None else -1, s["created"]), str(root / name)
        if not _serves_this_rank(s):  # a replica on a peer as a snapshot held here: one rule
            other_world.append((key, shown, s["world_size"], tuple(s["ranks_held"])))
            continue
        if s.get("on_peer"):
            if _my_rank() in s["ranks_held"] and key > there.get(shown, ((-2, 0.0),))[0]:  # a restore reads its own
                there[shown] = (key, _save_of(s), s["path"])
            continue
        prior = here.get(shown)
        if prior is None or s["created"] >= prior[1]:  # the path's latest write is its version, whatever its step:
            # a rollback (overwrite=True at a lower step) held in memory replaces the disk checkpoint of the path
            here[shown] = key
            saves[shown] = "" if s.get("persisted") else _save_of(s)  # persisted: the disk's own
    chosen = _chosen(here, saves, there, run_dir)
    _warn_other_world(other_world, None if chosen is None else here.get(chosen, there.get(chosen, ((-1, 0.0),))[0]))
    return None if chosen is None else user_path(chosen)  # an object: its s3:// URL


def _warn_other_world(other_world: list[tuple[Key, str, int, tuple[int, ...]]], chosen: Key | None) -> None:
    """Rank 0 names the newest snapshot passed over for its world size or its placement (one that spans nodes:
    its shards lie on the nodes that saved it), where it is newer than what the job resumes from."""
    newer = [entry for entry in other_world if chosen is None or entry[0] > chosen]
    if newer and _my_rank() == 0:
        (step, _), shown, world, ranks = max(newer)
        why = (f"this job has {_my_world()}" if world != _my_world() else
               f"this node holds the shards of ranks {list(ranks)}, not this rank's (the ranks were placed on other "
               f"nodes than when it was saved)")
        log.warning("ckptd.latest: %s (step %s) was saved by %d ranks and spans nodes; %s, so it is passed over, and "
                    "the job resumes from the newest checkpoint every rank can read", shown, step, world, why)


def _save_of(held: dict[str, Any]) -> str:
    """Which save a held snapshot is: its run, step and count (``StagedShard.save``), as every rank compares it."""
    return f"{held.get('job', '')}|{held['step']}|{held.get('save', 0)}"


Key = tuple[int, float]


def _chosen(here: dict[str, Key], saves: dict[str, str], there: dict[str, tuple[Key, str, str]],
            run_dir: str | os.PathLike | None) -> str | None:
    """The newest checkpoint every rank can restore (one process: the newest it can), reading a snapshot back
    from a peer's replica where this rank's node lost it.

    ``here``: what this rank can read now (path to its key), with ``saves`` naming which save of its path a
    snapshot is (none for a checkpoint on disk, whose one index every rank reads); ``there``: what a peer holds
    a replica of (path to key, save and the name it is held under). A path counts only where every rank holds, or
    can read back, the same save of it: a snapshot spread over several nodes whose nodes hold shards of different
    saves (a save some nodes held and others refused, or one cut short after some nodes replaced their older save
    with it) is never resumed as one checkpoint. The ranks pick by rank 0's keys, so every rank picks the same;
    where a read back fails on some rank, that choice is dropped on that rank and the ranks choose again, together.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        # a replica written after the version of its path here (a rollback this node lost) is the path's version
        best_here = max((k for p, k in here.items() if p not in there or there[p][0][1] <= k[1]), default=None)
        for shown, (key, _, held_as) in sorted(there.items(), key=lambda item: item[1][0], reverse=True):
            if shown in here and key[1] <= here[shown][1]:
                continue  # an earlier write of a path this node can read
            if best_here is not None and key <= best_here:
                break
            if restore_from_peer(held_as, run_dir):  # this node lost them: the newest that restores
                return shown
        return max(here, key=lambda p: (here[p], p)) if here else None
    from .coordinate import all_gather_msgpack

    group = dist.new_group(backend="gloo")
    try:
        while True:
            mine = [[p, *k, saves.get(p, "")] for p, k in sorted(here.items())]
            mine += [[p, *k, save] for p, (k, save, _) in sorted(there.items())]
            everyone = all_gather_msgpack(mine, group)
            common = set.intersection(*({(p, save) for p, _, _, save in rank} for rank in everyone))
            keys = {(p, save): (step, created) for p, step, created, save in everyone[0]}
            written = {}  # per path, its version written last (a rollback over its disk checkpoint), whatever its step
            for ps in common:
                if ps[0] not in written or keys[ps][1] > keys[written[ps[0]]][1]:
                    written[ps[0]] = ps
            best = max(written.values(), key=lambda ps: (keys[ps], ps), default=None)
            _pass_over(everyone, common, keys[best] if best is not None else (-1, 0.0))
            if best is None:
                return None
            path, save = best
            restored = True
            if (path not in here or saves.get(path, "") != save) and there.get(path, (None, None))[1] == save:
                restored = restore_from_peer(there.pop(path)[2], run_dir)
            if all(all_gather_msgpack(restored, group)):
                return path
    finally:
        dist.destroy_process_group(group)


PASSED_OVER: set[str] = set()
"""Snapshots newer than the one ``latest`` resumed from that some ranks' nodes hold and others do not (resolved
paths): this process's next save of such a path replaces what is held there (``Client._save_flat``), as the run
saves that step again; a save to it would otherwise be refused (``CheckpointExists``) on the nodes holding it."""


def passed_over(path: str) -> bool:
    """Whether ``latest`` passed over a snapshot held at ``path`` by some ranks' nodes only; forgets it (the save
    that asks replaces it, and a later save of the path is refused as any is)."""
    want = resolved(path)
    if want in PASSED_OVER:
        PASSED_OVER.discard(want)
        return True
    return False


def _pass_over(everyone: list[list[list[Any]]], common: set[tuple[str, str]], best: Key) -> None:
    """Every rank notes the newer snapshots some ranks hold and others do not, where the ranks resume from an
    older one (``PASSED_OVER``: a checkpoint on disk is never among them), and rank 0 says the newest."""
    import torch.distributed as dist

    lacking = sorted({(step, p, bool(save)) for rank in everyone for p, step, created, save in rank
                      if (p, save) not in common and (step, created) > best}, reverse=True)
    PASSED_OVER.update(resolved(p) for _, p, snapshot in lacking if snapshot)
    if lacking and dist.get_rank() == 0:
        log.warning("ckptd.latest: %s (step %s) is held by some ranks' nodes but not by every rank's (a node lost "
                    "with the peer holding its replica, or a replica that failed its check); resuming from what "
                    "every rank holds, and this run's next save of that path replaces it", lacking[0][1],
                    lacking[0][0])


def _serves_this_rank(held: dict[str, Any]) -> bool:
    """Whether this rank can resume from a snapshot this node holds, or from a peer's replica of it (read back
    first): all of it is there, or (a snapshot that spans nodes, of which the node holds its own ranks' shards)
    the world is the one that saved it and this rank's shard is among them. A world of another size would need
    shards held on other nodes, or none (a resharded resume reads every rank's regions): such a snapshot is
    passed over, and the ranks agree on what every one of them can read (a persisted checkpoint), never some from
    memory and others from disk. A replica is judged alike: one process restarted in place of two read back rank
    0's half and resumed from it as if it were the whole snapshot."""
    if len(held["ranks_held"]) >= held["world_size"]:
        return True
    return _my_world() == held["world_size"] and _my_rank() in held["ranks_held"]


def _my_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _my_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
