"""An object's name always reads ``s3://bucket/key``, never the one-slash form ``Path`` prints: in errors,
``ckptd list --json``, ``verify`` and ``export`` messages, ``ckptd status`` and the daemon's log, so a name
copied from any of them is one the CLI and the client take. A real daemon on moto's S3 server."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import ckptd_cli, keys, seeded_state as state, status, wait_until

import ckptd
from ckptd.protocol.endpoint import LOG_NAME

ONE_SLASH = re.compile(r"s3:/(?!/)")


def one_slash(text: str) -> list[str]:
    """The lines of ``text`` that spell an object name with one slash."""
    return [line for line in text.splitlines() if ONE_SLASH.search(line)]


def test_every_message_and_listing_names_an_object_by_its_url(s3, bucket, daemon_factory, client_factory, root,
                                                              run_dir, tmp_path) -> None:
    daemon = daemon_factory("--root", f"s3://{bucket}")
    url = f"s3://{bucket}/run/step-1"
    ckptd_client = client_factory()
    ckptd_client.save_async(state(seed=1), url, step=1).result(30)

    waiting = client_factory(rank=0, world_size=2, commit_timeout=300.0)
    fut = waiting.save_async(state(seed=2), f"s3://{bucket}/run/step-2", step=2)
    wait_until(lambda: daemon.status()["saves"], what="the save waiting for rank 1")
    shown = daemon.cli("status").stdout + daemon.cli("status", "--json").stdout
    client_factory(rank=1, world_size=2).save_async(state(seed=2), f"s3://{bucket}/run/step-2", step=2).result(60)
    fut.result(60)
    assert f"s3://{bucket}/run/step-2" in shown and one_slash(shown) == [], one_slash(shown)
    late = client_factory(rank=0, world_size=2, commit_timeout=1.0)
    with pytest.raises(ckptd.RanksMissing) as failed:
        late.save_async(state(seed=3), f"s3://{bucket}/run/step-3", step=3).result(60)
    assert f"s3://{bucket}/run/step-3" in str(failed.value) and one_slash(str(failed.value)) == []

    listed = ckptd_cli("list", f"s3://{bucket}/run", "--json")
    assert listed.returncode == 0 and one_slash(listed.stdout) == [], listed.stdout
    assert {e["path"] for e in json.loads(listed.stdout)} >= {url}

    s3.client().delete_object(Bucket=bucket, Key="run/step-1/rank-00000-of-00001.safetensors")
    for args in (("verify", url), ("export", url, str(tmp_path / "out"))):
        done = ckptd_cli(*args)
        assert done.returncode != 0 and url in done.stdout + done.stderr, done
        assert one_slash(done.stdout + done.stderr) == [], done

    assert daemon.stop(60) == 0
    log = (run_dir / LOG_NAME).read_text()
    assert f"s3://{bucket}/run/step-1" in log and one_slash(log) == [], one_slash(log)


def test_a_memory_snapshot_of_an_object_name_is_found_listed_loaded_and_persisted_by_its_url(
        s3, bucket, daemon_factory, client_factory, run_dir) -> None:
    daemon_factory("--root", f"s3://{bucket}")
    client = client_factory()
    prefix, url = f"s3://{bucket}/run", f"s3://{bucket}/run/step-5"
    client.save_async(state(seed=5), url, step=5, persist=False).result(30)
    assert keys(s3, bucket) == []  # held in memory only
    assert ckptd.latest(prefix, run_dir=run_dir) == url
    assert torch.equal(ckptd.load(url, run_dir=run_dir)["w"], state(seed=5)["w"])
    listed = ckptd_cli("list", prefix, "--json", "--run-dir", str(run_dir))
    assert listed.returncode == 0, listed
    assert [(e["path"], e["state"]) for e in json.loads(listed.stdout)] == [(url, "memory")]
    assert [s["path"] for s in status(run_dir)["memory"]["snapshots"]] == [url]  # a URL, never s3:/bucket
    text = ckptd_cli("status", "--run-dir", str(run_dir)).stdout
    assert url in text and one_slash(text) == [], text
    assert client.persist(url) == url
    assert keys(s3, bucket, "run/step-5/") == ["run/step-5/ckptd.json", "run/step-5/rank-00000-of-00001.safetensors"]
    assert ckptd.load(url)["step"] == 5  # from the bucket, no daemon asked
