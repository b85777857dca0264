"""The storage seam's local implementation, on real files (no daemon)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from ckptd.core.config import DaemonConfig
from ckptd.storage.backends import load_storage
from ckptd.storage.contract import Kind, LocalStorage, Storage


@pytest.fixture
def fs() -> LocalStorage:
    return LocalStorage()


def test_local_storage_implements_the_protocol(fs) -> None:
    assert isinstance(fs, Storage)


def test_a_shard_written_through_the_seam_reads_back_and_truncates_to_its_size(fs, tmp_path) -> None:
    path = tmp_path / "shard"
    fd, _direct = fs.open_new(path, direct=False)
    try:
        data = memoryview(b"x" * 5000 + b"\0" * (8192 - 5000))
        assert fs.pwrite(fd, data, 0) == 8192
        fs.truncate(fd, 5000)
        fs.fsync(fd)
    finally:
        fs.close(fd)
    assert path.read_bytes() == b"x" * 5000
    assert fs.read(path, 4990, 100) == b"x" * 10
    st = fs.stat(path)
    assert st is not None and (st.kind, st.size) == (Kind.FILE, 5000)


def test_write_file_replaces_content_durably(fs, tmp_path) -> None:
    path = tmp_path / "ckptd.json"
    fs.write_file(path, b"first, longer")
    fs.write_file(path, b"second")
    assert path.read_bytes() == b"second"


def test_directories_are_listed_without_following_links(fs, tmp_path) -> None:
    fs.mkdir(tmp_path / "a" / "b", parents=True, exist_ok=True)
    fs.touch(tmp_path / "a" / "marker")
    os.symlink(tmp_path / "a" / "b", tmp_path / "a" / "link")
    os.mkfifo(tmp_path / "a" / "fifo")
    kinds = {e.name: e.kind for e in fs.scandir(tmp_path / "a")}
    assert kinds == {"b": Kind.DIR, "marker": Kind.FILE, "link": Kind.LINK, "fifo": Kind.OTHER}
    assert fs.stat(tmp_path / "a" / "link").kind is Kind.LINK
    assert fs.stat(tmp_path / "a" / "link", follow=True).kind is Kind.DIR
    assert fs.stat(tmp_path / "missing") is None
    assert fs.stat(tmp_path / "a" / "marker" / "below") is None  # below a file: no such name


def test_reading_a_fifo_is_refused_without_blocking(fs, tmp_path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError):
        fs.read(tmp_path / "fifo", 0, 10)


def test_mkdir_refuses_an_existing_name_unless_asked(fs, tmp_path) -> None:
    fs.mkdir(tmp_path / "d")
    with pytest.raises(FileExistsError):
        fs.mkdir(tmp_path / "d")
    fs.mkdir(tmp_path / "d", exist_ok=True)
    fs.touch(tmp_path / "f")
    with pytest.raises(FileExistsError):
        fs.mkdir(tmp_path / "f", exist_ok=True)  # a file is not the directory asked for


def test_exchange_swaps_two_directories_and_rename_moves_one(fs, tmp_path) -> None:
    for name in ("old", "new"):
        fs.mkdir(tmp_path / name)
        fs.touch(tmp_path / name / name)
    fs.exchange(tmp_path / "new", tmp_path / "old")
    assert os.listdir(tmp_path / "old") == ["new"] and os.listdir(tmp_path / "new") == ["old"]
    fs.rename(tmp_path / "new", tmp_path / "aside")
    fs.fsync_dir(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["aside", "old"]
    with pytest.raises(OSError) as missing:
        fs.exchange(tmp_path / "nothing", tmp_path / "old")
    assert missing.value.errno == errno.ENOENT


def test_remove_tree_removes_what_is_there_and_ignores_what_is_not(fs, tmp_path) -> None:
    fs.mkdir(tmp_path / "t" / "deep", parents=True)
    fs.write_file(tmp_path / "t" / "deep" / "f", b"1234")
    fs.remove_tree(tmp_path / "t")
    fs.remove_tree(tmp_path / "t")
    assert not (tmp_path / "t").exists()
    fs.touch(tmp_path / "u")
    fs.unlink(tmp_path / "u")
    assert not (tmp_path / "u").exists()


def test_space_is_measured_at_the_nearest_existing_ancestor(fs, tmp_path) -> None:
    space = fs.space(tmp_path / "not" / "yet")
    assert space.device == os.stat(tmp_path).st_dev
    assert 0 <= space.free <= space.total and space.total > 0
    assert fs.resolve(tmp_path / "x" / "..") == Path(os.path.realpath(tmp_path))


def test_load_storage_names_what_is_wrong_with_the_option() -> None:
    assert isinstance(load_storage(None).local, LocalStorage)  # s3:// names go to the object store beside it
    assert isinstance(load_storage("ckptd.storage.contract:LocalStorage").local, LocalStorage)
    with pytest.raises(ValueError, match="module:Class"):
        load_storage("ckptd.storage.contract")
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_storage("ckptd.storage.contract:NoSuchClass")
    with pytest.raises(ValueError, match="does not implement"):
        load_storage("pathlib:PurePath")
    with pytest.raises(ValueError, match="names a module, not a class"):
        load_storage("os:path")
    with pytest.raises(ValueError, match="could not be created without arguments"):
        load_storage("datetime:date")


def test_a_daemon_config_refuses_a_storage_that_cannot_be_loaded(tmp_path) -> None:
    with pytest.raises(ValueError, match="--storage 'no.such.module:Storage' cannot be loaded"):
        DaemonConfig(run_dir=tmp_path, roots=(tmp_path,), storage="no.such.module:Storage")
    assert DaemonConfig(run_dir=tmp_path, roots=(tmp_path,), storage="ckptd.storage.contract:LocalStorage").storage
