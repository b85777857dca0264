"""The client under misuse: bad arguments, fork, Ctrl-C, odd files, small /dev/shm.

Every mistake fails its own call with an error that names it, and nothing
else: a save already in flight still commits, the client keeps saving, the
parent's slots survive a forked child, and a loaded checkpoint holds no
mapping or file once the call returns.
"""

from __future__ import annotations

import errno
import gc
import json
import math
import os
import resource
import shutil
import subprocess
import textwrap
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

import ckptd
from ckptd.client.slots import SlotPool
from ckptd.protocol.messages import Ping
from ckptd.protocol.shm import SHM_DIR_ENV

from helpers import short_tempdir
from zygote import run_script


def small_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {"w": torch.randn(64, 64), "b": torch.arange(10), "step": seed}


def mappings_of(path: Path) -> list[str]:
    """Lines of /proc/self/maps that map ``path`` (deleted or not)."""
    with open("/proc/self/maps") as f:
        return [line for line in f if str(path) in line]


def open_fds_on(path: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if str(path) in target:
            found.append(target)
    return found


# -- arguments -------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, names", [
    ({"max_inflight": 0}, ValueError, "max_inflight"),
    ({"max_inflight": True}, TypeError, "max_inflight"),
    ({"max_inflight": 1.5}, TypeError, "max_inflight"),
    ({"rank": "0", "world_size": 2}, TypeError, "rank"),
    ({"world_size": 0}, ValueError, "world_size"),
    ({"commit_timeout": math.inf}, ValueError, "commit_timeout"),
    ({"commit_timeout": math.nan}, ValueError, "commit_timeout"),
    ({"commit_timeout": -1.0}, ValueError, "commit_timeout"),
    ({"commit_timeout": 30 * 24 * 3600.0}, ValueError, "commit_timeout"),
    ({"timeout": 0}, ValueError, "timeout"),
    ({"heartbeat": math.nan}, ValueError, "heartbeat"),
    ({"heartbeat": "1"}, TypeError, "heartbeat"),
    ({"keep_last": 2**70}, ValueError, "keep_last"),
    ({"keep_last": 0}, ValueError, "keep_last"),
    ({"spawn": "no"}, TypeError, "spawn"),
    ({"run_dir": 3}, TypeError, "run_dir"),
])
def test_bad_client_arguments_are_refused_naming_the_argument(run_dir, kwargs, error, names) -> None:
    with pytest.raises(error, match=names):
        ckptd.Client(run_dir=run_dir, spawn=False, **kwargs)


def test_bad_save_arguments_fail_their_own_call_and_no_other_save(client, root) -> None:
    in_flight = client.save_async(small_state(1), root / "good", step=1, block=False)
    for kwargs, error in [({"step": 2**64}, ValueError), ({"step": -1}, ValueError), ({"step": True}, TypeError),
                          ({"step": 1.0}, TypeError), ({"keep_last": 2**70}, ValueError),
                          ({"overwrite": "yes"}, TypeError)]:
        name = next(iter(kwargs))
        with pytest.raises(error, match=name):
            client.save_async(small_state(2), root / "bad", **kwargs)
    with pytest.raises(TypeError, match="path"):
        client.save_async(small_state(2), None)
    looped = small_state(2)
    looped["opt"] = {"inner": [looped]}  # a reference cycle: named where it closes, not a RecursionError
    with pytest.raises(TypeError, match=r"state_dict\['opt'\]\['inner'\]\[0\] is a container that holds itself"):
        client.save_async(looped, root / "bad")
    shared = {"a": 1}
    assert client.save_async({"x": shared, "y": [shared, shared]}, root / "shared").result(30)  # shared, no cycle
    assert ckptd.load(root / "shared") == {"x": shared, "y": [shared, shared]}
    assert in_flight.result(30).step == 1 and (root / "good" / "ckptd.json").is_file()
    assert client.save_async(small_state(3), root / "after", step=2**63 - 1).result(30).step == 2**63 - 1
    assert not (root / "bad").exists()


def test_a_request_that_cannot_be_encoded_fails_alone_and_the_client_keeps_working(client, root) -> None:
    in_flight = client.save_async(small_state(1), root / "first", step=1)
    bad = client._conn.request(Ping(2**64))  # no public call can build this any more: the I/O seam itself
    assert isinstance(bad.exception(30), ValueError)
    assert in_flight.result(30).step == 1
    assert client.save_async(small_state(2), root / "second", step=2).result(30).step == 2


@pytest.mark.parametrize("call, kwargs, error, names", [
    ("load", {"rank": -1}, ValueError, "rank"),
    ("load", {"rank": "first"}, ValueError, "rank"),
    ("load", {"verify": "yes"}, TypeError, "verify"),
    ("load", {"mmap": 1}, TypeError, "mmap"),
    ("load", {"max_concurrent_per_node": 0}, ValueError, "max_concurrent_per_node"),
    ("load", {"map_location": 3}, TypeError, "map_location"),
    ("load", {"map_location": "nowhere:7"}, ValueError, "map_location"),
    ("load_into", {"rank": "all"}, ValueError, "rank"),
    ("load_into", {"strict": None}, TypeError, "strict"),
    ("load_into", {"key": 3}, TypeError, "key"),
    ("load_into", {"max_concurrent_per_node": -2}, ValueError, "max_concurrent_per_node"),
    ("load", {"run_dir": 5}, TypeError, "run_dir"),
    ("load", {"run_dir": ""}, ValueError, "run_dir"),
    ("load_into", {"run_dir": b"/tmp"}, TypeError, "run_dir"),
    ("latest", {"run_dir": 5}, TypeError, "run_dir"),
    ("latest", {"run_dir": ""}, ValueError, "run_dir"),
])
def test_bad_load_arguments_are_refused_naming_the_argument(tmp_path, call, kwargs, error, names) -> None:
    args = ({}, tmp_path) if call == "load_into" else (tmp_path,)
    with pytest.raises(error, match=names):
        getattr(ckptd, call)(*args, **kwargs)
    with pytest.raises(TypeError, match="path"):
        ckptd.load(None)


@pytest.mark.parametrize("target", [5, "model", None, (1, 2)])
def test_load_into_a_target_it_cannot_fill_is_a_type_error_naming_it(client, root, target) -> None:
    client.save_async(small_state(1), root / "saved", step=1).result(30)
    with pytest.raises(TypeError, match=f"target must be a state dict.*got {type(target).__name__}"):
        ckptd.load_into(target, root / "saved")


def test_latest_of_no_path_is_a_type_error_not_none() -> None:
    with pytest.raises(TypeError, match="root must be a path"):
        ckptd.latest(None)


@pytest.mark.parametrize("timeout, error", [(-1, ValueError), (float("nan"), ValueError), ("5", TypeError)])
def test_client_wait_refuses_a_timeout_that_is_not_seconds(daemon, client, timeout, error) -> None:
    with pytest.raises(error, match="timeout"):
        client.wait(timeout)
    client.wait(0.5)  # a real timeout still works


# -- fork --------------------------------------------------------------------

FORK_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch, ckptd
    run_dir, root = sys.argv[1], sys.argv[2]
    client = ckptd.Client(run_dir=run_dir, spawn=False, timeout=10.0)
    client.save_async({"w": torch.ones(1000)}, f"{root}/before").result(30)
    slots = client.slot_names
    pid = os.fork()
    if pid == 0:  # the child: using the client fails at once; a normal exit runs the atexit hooks
        try:
            client.save_async({"w": torch.ones(10)}, f"{root}/child")
            outcome = "saved"
        except RuntimeError as exc:
            outcome = str(exc)
        client.close()  # must not touch the parent's slots either
        print(json.dumps({"child": outcome}), flush=True)
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    alive = all(os.path.exists(f"/dev/shm/{name}") for name in slots)
    result = client.save_async({"w": torch.ones(1000)}, f"{root}/after").result(30)
    client.close()
    print(json.dumps({"child_status": status, "slots_alive_after_child_exit": alive, "after": str(result.path)}))
""")


def test_a_forked_child_cannot_use_the_client_and_leaves_the_parents_slots_alone(daemon, run_dir, root) -> None:
    out = run_script(FORK_SCRIPT, str(run_dir), str(root), timeout=120)
    assert out.returncode == 0, out.stderr
    child, parent = (json.loads(line) for line in out.stdout.splitlines())
    assert "forked child" in child["child"] and "new ckptd.Client" in child["child"]
    assert parent["child_status"] == 0
    assert parent["slots_alive_after_child_exit"] is True
    assert (root / "after" / "ckptd.json").is_file() and not (root / "child").exists()


FRESH_CLIENT_IN_CHILD = textwrap.dedent("""
    import os, sys, time, torch, ckptd
    run_dir, root = sys.argv[1], sys.argv[2]
    torch.set_num_threads(2)
    torch.ones(1 << 22).fill_(1.0)  # the parent's OpenMP pool has run: a parallel op in the child would hang
    pid = os.fork()
    if pid == 0:  # what the error advises: a new client in the child
        with ckptd.Client(run_dir=run_dir, spawn=False, timeout=10.0) as fresh:
            fresh.save_async({"w": torch.ones(10)}, f"{root}/child-new").result(30)
        os._exit(0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("exit", status)
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        print("hung")
""")


def test_a_new_client_in_a_forked_child_saves_without_hanging(daemon, run_dir, root) -> None:
    out = run_script(FRESH_CLIENT_IN_CHILD, str(run_dir), str(root), timeout=120)
    assert out.stdout.split() == ["exit", "0"], out.stdout + out.stderr
    assert (root / "child-new" / "ckptd.json").is_file()


# -- Ctrl-C during staging --------------------------------------------------------


class _RaisesOnCopy(torch.Tensor):
    """A tensor whose copy into the slot raises ``to_raise`` (as a Ctrl-C would, mid-copy)."""

    to_raise: type[BaseException] = KeyboardInterrupt

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.copy_, torch._foreach_copy_):  # staging copies with either
            raise cls.to_raise()
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_ctrl_c_during_staging_reaches_the_caller_and_the_client_still_saves(client_factory, daemon, root,
                                                                            interrupt) -> None:
    client = client_factory(max_inflight=1)
    client.save_async(small_state(1), root / "one").result(30)
    slots = client.slot_names
    _RaisesOnCopy.to_raise = interrupt
    poisoned = {"w": torch.randn(64, 64).as_subclass(_RaisesOnCopy)}
    with pytest.raises(interrupt):
        client.save_async(poisoned, root / "interrupted")
    # The in-flight place came back (block=False would raise Busy) and so did the slot (no new one made).
    result = client.save_async(small_state(2), root / "two", block=False).result(30)
    assert result.path == root / "two" and client.slot_names == slots
    assert not (root / "interrupted").exists()


def test_a_slot_a_save_gives_back_after_close_is_unlinked() -> None:
    """Ctrl-C inside ``close`` leaves a background save running past the pool's close: the slot that save took
    (after the close) and gives back when it ends must go too, not sit in a closed pool until the process exits."""
    pool = SlotPool(2)
    early = pool.take(4096)
    pool.close()  # what close() did before the Ctrl-C cut its wait short
    late = pool.take(4096)  # the background save, still staging
    assert late.path.exists()
    for slot in (early, late):
        pool.give_back(slot)
        assert not slot.path.exists() and slot.map.closed
    assert pool.names == []


# -- loaded checkpoints own their memory ------------------------------------------


@pytest.fixture
def saved_model(client, root) -> tuple[Path, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    client.save_async({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}, root / "ckpt").result(30)
    return root / "ckpt", model


def test_default_load_owns_its_memory_and_keeps_nothing_of_the_file(saved_model) -> None:
    path, model = saved_model
    shard = path / "rank-00000-of-00001.safetensors"
    state = ckptd.load(path)
    storages = {t.untyped_storage().data_ptr() for t in state["model"].values()}
    assert len(storages) == len(state["model"])
    shutil.rmtree(path)  # as retention would
    assert mappings_of(shard) == [] and open_fds_on(shard) == []
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())


def test_mmap_load_maps_the_shard_until_its_tensors_go(saved_model) -> None:
    path, _ = saved_model
    shard = path / "rank-00000-of-00001.safetensors"
    gc.disable()
    try:
        state = ckptd.load(path, mmap=True)
        assert mappings_of(shard), "mmap=True returns views of a mapping of the shard"
        del state
        assert mappings_of(shard) == []
    finally:
        gc.enable()


def test_load_into_releases_its_mapping_when_it_returns_without_the_garbage_collector(saved_model) -> None:
    path, model = saved_model
    shard = path / "rank-00000-of-00001.safetensors"
    target = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    gc.collect()
    gc.disable()
    try:
        report = ckptd.load_into(target, path, key="model")
        assert report.copied == 4
        assert mappings_of(shard) == [] and open_fds_on(shard) == []
        opt = torch.optim.AdamW(target.parameters())
        ckptd.load_into(opt, path, key="optimizer")  # no state yet: through its own load_state_dict
        assert mappings_of(shard) == [] and len(opt.state) == 4
        ckptd.load_into(opt, path, key="optimizer")  # with state: copied in place
        assert mappings_of(shard) == []
    finally:
        gc.enable()
    assert all(torch.equal(target.state_dict()[k], v) for k, v in model.state_dict().items())


def test_default_load_still_detects_a_corrupt_byte(saved_model) -> None:
    path, _ = saved_model
    shard = path / "rank-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ckptd.InvalidCheckpoint, match="fails its checksum"):
        ckptd.load(path)
    assert ckptd.load(path, verify=False)["step"] == 1


# -- non-regular files -------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_fifo_in_place_of_a_shard_or_the_index_is_refused_never_read(saved_model) -> None:
    path, model = saved_model
    shard = path / "rank-00000-of-00001.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    for call in (lambda: ckptd.load(path), lambda: ckptd.load(path, mmap=True),
                 lambda: ckptd.load_into(model, path, key="model"), lambda: ckptd.inspect(path)):
        with pytest.raises(ckptd.InvalidCheckpoint, match=f"{shard} is not a regular file \\(a FIFO\\)"):
            call()
    report = ckptd.verify_checkpoint(path)
    assert not report.ok and "is not a regular file (a FIFO)" in report.problems[0]
    index = path / "ckptd.json"
    index.unlink()
    os.mkfifo(index)
    with pytest.raises(ckptd.InvalidCheckpoint, match="index .*ckptd.json is not a regular file"):
        ckptd.load(path)
    assert not ckptd.verify_checkpoint(path).ok and ckptd.latest(path.parent) is None


def test_a_huge_file_in_place_of_an_index_is_refused_unread(saved_model) -> None:
    """A stray multi-GiB ``ckptd.json`` (sparse here) is refused by its size: latest, load and verify never read
    it into memory, and latest still finds the good checkpoint beside it."""
    path, _ = saved_model
    junk = path.parent / "junk"
    junk.mkdir()
    with open(junk / "ckptd.json", "wb") as f:
        f.truncate(3 << 30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for call in (lambda: ckptd.load(junk), lambda: ckptd.read_index(junk)):
        with pytest.raises(ckptd.InvalidCheckpoint, match="ckptd.json is 3221225472 bytes, more than any index"):
            call()
    assert "more than any index" in ckptd.verify_checkpoint(junk).problems[0]
    assert ckptd.latest(path.parent) == path
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < (1 << 30) // 1024  # KiB: nothing read


# -- types that round-trip ----------------------------------------------------------


def test_ordered_dict_and_torch_size_round_trip_exactly(client, root) -> None:
    model = nn.Linear(4, 2)
    state = {"model": model.state_dict(), "shape": torch.Size([3, 5]),
             "nested": [OrderedDict([("z", 1), ("a", (torch.Size([]), torch.zeros(2)))])], "plain": {"k": (1, 2)}}
    client.save_async(state, root / "types").result(30)
    loaded = ckptd.load(root / "types")
    assert type(loaded["model"]) is OrderedDict and list(loaded["model"]) == list(model.state_dict())
    assert type(loaded["shape"]) is torch.Size and loaded["shape"] == torch.Size([3, 5])
    nested = loaded["nested"][0]
    assert type(nested) is OrderedDict and list(nested) == ["z", "a"]
    assert type(nested["a"][0]) is torch.Size and type(nested["a"]) is tuple
    assert type(loaded["plain"]) is dict and loaded["plain"] == {"k": (1, 2)}


# -- shared memory in containers ------------------------------------------------------


def _small_tmpfs(directory: Path) -> bool:
    """Mount a 4 MiB tmpfs at ``directory`` (needs root and CAP_SYS_ADMIN; False if refused)."""
    try:
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(directory)], capture_output=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


def test_too_little_shared_memory_says_how_much_is_needed_and_how_to_get_more(monkeypatch, daemon_factory,
                                                                             client_factory, root) -> None:
    shm = short_tempdir("ckshm-")
    mounted = _small_tmpfs(shm)
    try:
        monkeypatch.setenv(SHM_DIR_ENV, str(shm))
        daemon_factory()
        client = client_factory()
        if not mounted:  # no tmpfs to fill: the reservation fails as a full one does (fault injection)
            def no_room(fd: int, offset: int, length: int) -> None:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            monkeypatch.setattr(os, "posix_fallocate", no_room)
        big = {"w": torch.zeros(2 * 1024 * 1024)}  # 8 MiB
        with pytest.raises(ckptd.NoSpace) as info:
            client.save_async(big, root / "big").result(30)
        message = str(info.value)
        free = shutil.disk_usage(shm).free
        assert f"needs {9 * 2**20} bytes" in message and f"{free} bytes" in message, message
        assert str(shm) in message and "--shm-size" in message and "emptyDir" in message and SHM_DIR_ENV in message
        assert isinstance(info.value, ckptd.CkptdError) and not list(shm.iterdir())
    finally:
        if mounted:
            subprocess.run(["umount", str(shm)], timeout=30)
        shutil.rmtree(shm, ignore_errors=True)


def test_slot_directory_is_configurable_for_client_and_daemon_and_shown_in_status(monkeypatch, daemon_factory,
                                                                                 client_factory, root) -> None:
    shm = short_tempdir("ckshm-")
    try:
        monkeypatch.setenv(SHM_DIR_ENV, str(shm))
        daemon = daemon_factory()
        client = client_factory()
        result = client.save_async(small_state(1), root / "elsewhere").result(30)
        assert result.path == root / "elsewhere"
        assert sorted(p.name for p in shm.iterdir()) == sorted(client.slot_names)
        assert not any(Path("/dev/shm", n).exists() for n in client.slot_names)
        status = daemon.status()["shm"]
        usage = shutil.disk_usage(shm)
        assert status["dir"] == str(shm) and status["total_bytes"] == usage.total
        assert isinstance(status["free_bytes"], int) and status["free_bytes"] > 0
        assert f"shared memory {shm}:" in daemon.cli("status").stdout
        client.close()
        assert not list(shm.iterdir())
    finally:
        shutil.rmtree(shm, ignore_errors=True)
