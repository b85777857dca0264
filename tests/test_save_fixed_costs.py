"""A save's fixed costs: the layout is planned once while the structure holds, a commit names a table the daemon
checked before by its digest, slots can be reserved up front."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import ckptd
from ckptd.client.flatten import flatten
from ckptd.client.slots import Slot
from ckptd.client.staging import LayoutCache
from ckptd.protocol.errors import ErrorCode
from ckptd.protocol.layout import plan_layout, validate_entries
from ckptd.protocol.messages import WriteShard, Error, Hello, decode

from helpers import raw_socket, wait_until


def mixed(step: int) -> dict:
    """Mixed dtypes, a 0-dim and an empty tensor, a non-contiguous view: what the batched copy must get right."""
    base = torch.arange(24.0).reshape(4, 6)
    return {"w": base.t(), "i": torch.arange(5, dtype=torch.int64) * step, "h": torch.ones(3, dtype=torch.float16),
            "s": torch.tensor(float(step)), "e": torch.empty(0, 2), "step": step}


def test_one_client_saving_changing_structures_writes_each_as_it_was(client, root) -> None:
    states = [mixed(1), mixed(2),  # same structure, new values and a new plain value
              {**mixed(3), "w": torch.zeros(6, 5)},  # a shape changes
              {**mixed(4), "h": torch.ones(3, dtype=torch.bfloat16)},  # a dtype changes
              {**mixed(5), "extra": torch.ones(2)},  # a key is added
              mixed(6)]  # back to the first structure
    for i, state in enumerate(states):
        client.save_async(state, root / f"c{i}").result(30)
    for i, state in enumerate(states):
        loaded = ckptd.load(root / f"c{i}")
        assert loaded.keys() == state.keys() and loaded["step"] == state["step"]
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), (i, k)


def test_the_layout_and_slot_views_are_reused_while_the_structure_holds() -> None:
    cache, slot = LayoutCache(), Slot(1 << 20)
    try:
        first = cache.layout(flatten(mixed(1)))
        views = cache.views(first, slot)
        state = mixed(1)
        state["i"].add_(7)  # new values, same structure
        assert cache.layout(flatten(state)) is first and cache.views(first, slot) is views
        assert cache.layout(flatten(mixed(2))) is not first  # a plain value is part of the structure
        assert cache.layout(flatten({**mixed(1), "w": torch.zeros(6, 5)})) is not first
    finally:
        slot.close()


def test_a_reserved_slot_serves_the_first_save(daemon, client_factory, root) -> None:
    state = {"w": torch.arange(float((2 << 20) // 4))}  # exactly the reserved tensor bytes: the header fits beside
    client = client_factory(reserve_bytes=2 << 20)
    reserved = client.slot_names
    assert len(reserved) == 1  # made at construction, before any save
    client.save_async(state, root / "first").result(30)
    assert client.slot_names == reserved
    assert torch.equal(ckptd.load(root / "first")["w"], state["w"])
    client.save_async({"w": torch.zeros(1_000_000)}, root / "bigger").result(30)  # outgrows it: a new slot
    assert client.slot_names != reserved


@pytest.mark.parametrize("value, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError),
                                          (2**63 - 1, ValueError), (10**15, ckptd.NoSpace)])
def test_a_bad_reserve_bytes_is_refused_naming_it(daemon, run_dir, value, error) -> None:
    with pytest.raises(error, match="reserve_bytes"):
        ckptd.Client(run_dir=run_dir, spawn=False, reserve_bytes=value)



def small_state(step: int) -> dict:
    """A thousand small tensors, the same structure every step (plain values too): what a fixed cost is paid on."""
    return {"w": {f"t{i}": torch.full((16,), float(step * 1000 + i)) for i in range(1000)}, "mixed": mixed(1)}


def sent_commits(client) -> list[WriteShard]:
    """Record the commits ``client`` puts on its socket (a spy: they still go out unchanged)."""
    conn, seen = client._conn, []
    request = conn.request
    conn.request = lambda msg, **kw: (seen.append(msg) if isinstance(msg, WriteShard) else None, request(msg, **kw))[1]
    return seen


def test_a_save_of_an_unchanged_structure_names_its_table_and_is_written_whole(client, root) -> None:
    seen = sent_commits(client)
    for step in range(3):
        client.save_async(small_state(step), root / f"s{step}").result(30)
    client.save_async({**small_state(3), "extra": torch.ones(2)}, root / "changed").result(30)
    assert [len(c.tensors) for c in seen] == [1005, 0, 0, 1006]  # the table goes once per structure
    assert len({c.layout for c in seen[:3]}) == 1 and seen[3].layout != seen[0].layout
    for step in range(3):
        loaded = ckptd.load(root / f"s{step}")
        assert all(torch.equal(loaded["w"][k], v) for k, v in small_state(step)["w"].items())
    assert torch.equal(ckptd.load(root / "changed")["extra"], torch.ones(2))


def test_a_client_whose_daemon_restarted_sends_the_table_it_named_again(daemon_factory, client_factory, root) -> None:
    daemon = daemon_factory()
    client = client_factory(heartbeat=0.2, timeout=5.0)
    client.save_async(small_state(1), root / "before").result(30)
    daemon.kill()
    daemon_factory()  # knows no table of this client
    client.save_async(small_state(2), root / "after").result(30)
    assert torch.equal(ckptd.load(root / "after")["w"]["t7"], small_state(2)["w"]["t7"])


def test_a_commit_may_name_only_a_table_its_own_connection_sent_and_the_daemon_checked(daemon, root) -> None:
    """The daemon keeps the table it decoded and checked itself, per connection: a digest is never taken on trust."""
    layout = plan_layout([("w", "F32", (4,)), ("b", "F32", (2,))], {})
    table = validate_entries(layout.entries, layout.nbytes - layout.data_start)
    full = WriteShard(7, f"ckptd-{os.getuid()}-{os.getpid()}-0", layout.nbytes, layout.data_start, table,
                  str(root / "x"), 0, 1, None, False, False, None, 60.0, 0.0, layout.nbytes, layout=table.digest)
    naming = dataclasses.replace(full, tensors=())
    sender, other = raw_socket(daemon), raw_socket(daemon)
    try:
        for sock in (sender, other):
            sock.send(Hello(1, os.getpid(), os.getuid(), "test").to_wire())
            assert decode(sock.recv()).type == "welcome"

        def reply(sock, msg) -> Error:
            sock.send(msg.to_wire())
            answer = decode(sock.recv())
            assert isinstance(answer, Error), answer
            return answer

        refused = reply(sender, naming)  # not sent yet
        assert refused.code == ErrorCode.BAD_MESSAGE and table.digest in refused.message
        wire = full.to_wire().replace(table.digest.encode(), b"0" * 32)  # a digest that is not the table's
        sender.send(wire)
        assert "is not the digest of" in decode(sender.recv()).message
        assert reply(sender, full).code == ErrorCode.BAD_SLOT  # checked and kept, then refused: no such slot
        assert reply(sender, naming).code == ErrorCode.BAD_SLOT  # the daemon found the table: on to the slot
        assert "did not send" in reply(other, naming).message  # another connection's table
        wrong_size = dataclasses.replace(naming, nbytes=naming.nbytes + 4, staged=naming.nbytes + 4)
        assert "covers 24 bytes of data" in reply(sender, wrong_size).message
    finally:
        sender.close()
        other.close()
    assert daemon.status()["daemon"]["pid"] == daemon.proc.pid


def mapped_kib(pid: int, path: str) -> int:
    """Resident KiB of process ``pid``'s mapping of file ``path`` (0 if it maps none)."""
    block, rss = False, 0
    for line in open(f"/proc/{pid}/smaps"):
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            block = line.rstrip().endswith(path)
        elif block and line.startswith("Rss:"):
            rss += int(line.split()[1])
    return rss


@pytest.mark.timeout(60)
def test_admission_maps_a_new_slot_without_faulting_it_in_and_the_write_reads_it_whole(
        daemon_factory, client_factory, root, tmp_path) -> None:
    """The first save waits for Accepted; pre-faulting a GiB there cost ~0.1 s of it. The write faults pages in."""
    go = tmp_path / "go"
    daemon = daemon_factory(faults=[{"op": "touch", "match": "first.incomplete", "errno": 0, "wait_for": str(go)}])
    client = client_factory()
    state = {"w": torch.arange(8 << 20, dtype=torch.float32)}  # 32 MiB
    pending = client.save_async(state, root / "first")  # returns once the daemon accepted (mapped) the slot
    (slot,) = client.slot_names
    wait_until(lambda: "event=fault op=touch" in (daemon.run_dir / "ckptd.log").read_text(), 20, "the write waits")
    resident = mapped_kib(daemon.proc.pid, slot)
    go.touch()
    assert pending.result(30).bytes_written > 32 << 20
    assert resident < 4 << 10, f"the daemon's mapping of the slot held {resident} KiB before the write"
    assert torch.equal(ckptd.load(root / "first")["w"], state["w"])
