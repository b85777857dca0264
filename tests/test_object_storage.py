"""Checkpoints on an object store: a real daemon saving to, and clients reading from, a real S3
HTTP endpoint on localhost (moto's server, ``tests/s3server.py``), through the same client library
as against AWS."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import keys, seeded_state as state, wait_until
from s3server import free_port

import ckptd
from ckptd.protocol.errors import InvalidCheckpoint, WriteFailed
from ckptd.protocol.index import INDEX_NAME


def test_a_save_to_s3_round_trips_through_the_bucket(s3, bucket, daemon_factory, client_factory, root) -> None:
    daemon_factory("--root", f"s3://{bucket}")
    client = client_factory()
    url = f"s3://{bucket}/run/step-1"
    result = client.save_async(state(200_000, 1), url, step=1).result(30)
    assert result.path == url  # an object's name comes back as its URL
    assert keys(s3, bucket) == ["run/step-1/ckptd.json", "run/step-1/rank-00000-of-00001.safetensors"]
    loaded = ckptd.load(url)
    assert torch.equal(loaded["w"], state(200_000, 1)["w"]) and loaded["step"] == 1
    target = {"w": torch.zeros(200_000), "b": torch.zeros(7, dtype=torch.int64), "step": 0}
    ckptd.load_into(target, url)
    assert torch.equal(target["w"], state(200_000, 1)["w"])
    with pytest.raises(TypeError, match="target must be a state dict.*got int"):
        ckptd.load_into(5, url)
    assert not s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_status_shows_a_bucket_root_as_an_object_store_without_free_bytes(s3, bucket, daemon_factory, root) -> None:
    """A store enforces its own quotas: status says which root is one (the seam's ``Space.bounded``), never the
    placeholder it reports as free space; a local root beside it shows its filesystem's numbers."""
    daemon = daemon_factory("--root", f"s3://{bucket}", "--root", str(root))
    roots = {r["path"]: r for r in daemon.status()["roots"]}
    assert roots[f"s3://{bucket}"] == {"path": f"s3://{bucket}", "free_bytes": None, "total_bytes": None,
                                       "object_store": True}
    local = roots[str(root)]
    assert "object_store" not in local and 0 < local["free_bytes"] <= local["total_bytes"]


def test_names_that_say_bucket_are_names_like_any_other(s3, aws, daemon_factory, client_factory, root) -> None:
    """A missing bucket is told apart from a missing object by its type, never by the word "bucket" in a message
    that names the object (saves to the README's own s3://my-bucket failed: the first HEAD's "no such object"
    named ``my-bucket`` and was taken for a missing bucket)."""
    bucket = aws.new_bucket("my-bucket")
    (root / "mir").mkdir()
    daemon_factory("--root", f"s3://{bucket}", "--mirror", f"{root / 'mir'}=s3://{bucket}/mirror/my-bucket-exp")
    client = client_factory()
    url = f"s3://{bucket}/runs/my-bucket-exp/step-1"
    assert client.save_async(state(1000, 1), url, step=1).result(30).path == url
    assert torch.equal(ckptd.load(url)["w"], state(1000, 1)["w"])
    assert ckptd.latest(f"s3://{bucket}/runs/my-bucket-exp") == url
    client.save_async(state(1000, 2), root / "mir" / "step-2", step=2).result(30)
    mirrored = f"s3://{bucket}/mirror/my-bucket-exp/step-2"
    wait_until(lambda: ckptd.latest(f"s3://{bucket}/mirror/my-bucket-exp") == mirrored, 60, "the upload")
    assert torch.equal(ckptd.load(mirrored)["w"], state(1000, 2)["w"])


def test_latest_and_list_read_a_prefix_and_retention_keeps_the_newest(s3, bucket, daemon_factory, client_factory,
                                                                      root) -> None:
    daemon = daemon_factory("--root", f"s3://{bucket}")
    client = client_factory()
    for step in (1, 2, 3):
        client.save_async(state(seed=step), f"s3://{bucket}/run/step-{step}", step=step, keep_last=2).result(30)
    wait_until(lambda: not any(k.startswith("run/step-1/") for k in keys(s3, bucket)), what="step-1 deleted by retention")
    assert ckptd.latest(f"s3://{bucket}/run") == f"s3://{bucket}/run/step-3"
    assert ckptd.load(ckptd.latest(f"s3://{bucket}/run"))["step"] == 3
    listed = daemon.cli("list", f"s3://{bucket}/run", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [(r["name"], r["state"], r["step"]) for r in __import__("json").loads(listed.stdout)] == [
        ("step-2", "committed", 2), ("step-3", "committed", 3)]


def test_a_checkpoint_is_invisible_until_its_index_is_written(s3, bucket, daemon_factory, client_factory, root) -> None:
    """Rank 0's shard is whole on the store while rank 1 has not committed: readers see no checkpoint."""
    daemon = daemon_factory("--root", f"s3://{bucket}")
    ranks = [client_factory(rank=r, world_size=2) for r in range(2)]
    url = f"s3://{bucket}/run/step-5"
    first = ranks[0].save_async(state(seed=5), url, step=5)
    wait_until(lambda: "run/step-5/rank-00000-of-00002.safetensors" in keys(s3, bucket), what="rank 0's shard uploaded")
    assert not first.done()
    pending = [c["path"] for c in daemon.status()["checkpoints"]]  # checked below, once nothing waits on rank 1
    assert ckptd.latest(f"s3://{bucket}/run") is None
    with pytest.raises(InvalidCheckpoint, match="no checkpoint at s3://"):
        ckptd.load(url, rank=0)
    assert f"run/step-5/{INDEX_NAME}" not in keys(s3, bucket)
    ranks[1].save_async(state(seed=6), url, step=5).result(30)
    first.result(30)
    assert ckptd.load(url, rank=1)["step"] == 6
    assert pending == [url]  # status names a checkpoint on a store by its URL
    with pytest.raises(InvalidCheckpoint, match=f"checkpoint {url} into the target"):  # errors name the URL
        ckptd.load_into({"not-saved": torch.zeros(1)}, url, rank=1)


def test_an_endpoint_that_stops_mid_upload_fails_the_save_and_a_later_save_works(s3, bucket, daemon_factory,
                                                                                 client_factory, root) -> None:
    daemon = daemon_factory("--root", f"s3://{bucket}")
    client = client_factory()
    url = f"s3://{bucket}/run/big"
    fut = client.save_async({"w": torch.ones(96 * 2**20 // 4)}, url, step=1)  # 96 MiB: many parts
    wait_until(lambda: any(s.get("written", 0) > 0 for s in daemon.status()["saves"]), what="the upload under way")
    s3.stop()
    try:  # every byte handed to the upload, which retries its parts: the shard is completing, not in fsync
        wait_until(lambda: [s["state"] for s in daemon.status()["saves"]] == ["completing"], what="the upload completing")
        assert f"root s3://{bucket}: object store (free space: not applicable)" in daemon.cli("status").stdout
        with pytest.raises(WriteFailed, match=f"endpoint {s3.url} unreachable for bucket '{bucket}'") as failure:
            fut.result(120)
        assert "rank-00000-of-00001.safetensors" in str(failure.value)
        assert daemon.status()["daemon"]["pid"] == daemon.proc.pid  # still serving
    finally:
        s3.start()
    assert f"run/big/{INDEX_NAME}" not in keys(s3, bucket)
    assert ckptd.latest(f"s3://{bucket}/run") is None
    client.save_async(state(seed=2), f"s3://{bucket}/run/after", step=2).result(30)
    assert ckptd.load(f"s3://{bucket}/run/after")["step"] == 2


def test_a_bucket_that_does_not_exist_is_named_in_the_error(s3, bucket, daemon_factory, client_factory, root) -> None:
    missing = bucket
    daemon_factory("--root", f"s3://{missing}")
    s3.client().delete_bucket(Bucket=missing)  # gone after the start (which checks it): every save there fails
    client = client_factory()
    with pytest.raises(ckptd.CkptdError, match=f"bucket '{missing}' does not exist"):
        client.save_async(state(), f"s3://{missing}/run/a", step=1).result(30)
    with pytest.raises(InvalidCheckpoint, match=f"bucket '{missing}' does not exist"):
        ckptd.load(f"s3://{missing}/run/a")
    with pytest.raises(InvalidCheckpoint, match=f"bucket '{missing}' does not exist"):
        ckptd.latest(f"s3://{missing}/run")  # a misspelt bucket is not "no checkpoint yet"


@pytest.mark.parametrize("rule", [("--root", "s3://{missing}/runs"), ("--mirror", "{root}=s3://{missing}/m")])
def test_start_refuses_a_root_or_mirror_in_a_bucket_that_does_not_exist(rule, s3, bucket, root, run_dir) -> None:
    missing = f"{bucket}-missing"
    done = subprocess.run([sys.executable, "-m", "ckptd", "start", "--foreground", "--run-dir", str(run_dir),
                           "--root", str(root), rule[0], rule[1].format(root=root, missing=missing)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"{rule[0]} " in done.stderr and f"bucket '{missing}' does not exist" in done.stderr, done.stderr
    assert not (run_dir / "ckptd.sock").exists()


WITHOUT_OBSTORE = "import sys; sys.modules['obstore'] = None; from ckptd.cli import main; sys.exit(main(sys.argv[1:]))"
"""``ckptd`` as it runs where the s3 extra is not installed (importing obstore fails)."""


@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize("rule", [("--root", "s3://bkt/runs"), ("--mirror", "{root}=s3://bkt/m")])
def test_start_without_the_s3_extra_refuses_an_s3_name_with_the_install_command(rule, detach, root,
                                                                                  run_dir) -> None:
    done = subprocess.run([sys.executable, "-c", WITHOUT_OBSTORE, "start", *([] if detach else ["--foreground"]),
                           "--run-dir", str(run_dir), "--root", str(root), rule[0], rule[1].format(root=root)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "pip install 'ckptd[s3]'" in done.stderr, done.stderr
    assert not (run_dir / "ckptd.sock").exists()


def test_an_s3_checkpoint_is_never_replaced_in_place(s3, bucket, daemon_factory, client_factory, root) -> None:
    daemon_factory("--root", f"s3://{bucket}")
    client = client_factory()
    url = f"s3://{bucket}/run/step-1"
    client.save_async(state(seed=1), url, step=1).result(30)
    before = s3.client().list_objects_v2(Bucket=bucket)["Contents"]
    with pytest.raises(ckptd.CheckpointExists, match="a save does not replace a checkpoint"):
        client.save_async(state(seed=2), url, step=1, overwrite=True).result(30)
    assert ckptd.load(url)["step"] == 1
    assert s3.client().list_objects_v2(Bucket=bucket)["Contents"] == before  # refused before anything was written


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_memory_snapshot_of_a_name_the_store_holds_is_refused_when_taken(overwrite, s3, bucket, daemon_factory,
                                                                           client_factory, root) -> None:
    """As a direct save of it is: a store never replaces a checkpoint, so such a snapshot could never be persisted
    (it was held, its persist on exit failed and ``ckptd stop`` exited 3 naming it; cf. the stateful soak, ``tiers``)."""
    daemon = daemon_factory("--root", f"s3://{bucket}")
    client = client_factory()
    url = f"s3://{bucket}/snap/step-1"
    client.save_async(state(seed=1), url, step=1).result(30)
    with pytest.raises(ckptd.CheckpointExists, match="already exists on the object store"):
        client.save_async(state(seed=5), url, step=1, persist=False, overwrite=overwrite).result(30)
    assert daemon.status()["memory"]["snapshots"] == []
    client.save_async(state(seed=2), f"s3://{bucket}/snap/step-2", step=2, persist=False).result(30)  # a free name
    client.close()
    assert daemon.stop(60) == 0
    assert ckptd.load(url)["step"] == 1 and ckptd.load(f"s3://{bucket}/snap/step-2")["step"] == 2


def test_a_save_without_credentials_fails_as_a_write_that_names_them(s3, bucket, daemon_factory, client_factory,
                                                                     root, monkeypatch) -> None:
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", "/nonexistent")  # no ~/.aws either
    daemon_factory("--root", f"s3://{bucket}")
    with pytest.raises(WriteFailed, match=f"cannot create s3://{bucket}/run/a: no usable AWS credentials"):
        client_factory().save_async(state(), f"s3://{bucket}/run/a", step=1).result(60)


def test_verify_and_inspect_read_an_s3_checkpoint(s3, bucket, daemon_factory, client_factory, root) -> None:
    daemon = daemon_factory("--root", f"s3://{bucket}")
    url = f"s3://{bucket}/run/step-1"
    client_factory().save_async(state(seed=1), url, step=1).result(30)
    verified = daemon.cli("verify", url)
    assert verified.returncode == 0 and "ok" in verified.stdout, verified.stderr
    inspected = daemon.cli("inspect", url, "--json")
    assert inspected.returncode == 0, inspected.stderr
    assert {t["name"] for t in __import__("json").loads(inspected.stdout)["shards"][0]["tensors"]} == {"w", "b"}
    s3.client().put_object(Bucket=bucket, Key="run/step-1/rank-00000-of-00001.safetensors", Body=b"x" * 10)
    damaged = daemon.cli("verify", url)
    assert damaged.returncode != 0 and "holds 10 bytes" in damaged.stderr


def test_a_mirror_uploads_committed_checkpoints_index_last_and_keeps_its_own_retention(s3, bucket, daemon_factory,
                                                                                      client_factory, root) -> None:
    daemon = daemon_factory("--mirror", f"{root}=s3://{bucket}/mirror", "--mirror-keep", "2", "--keep", f"{root}=3")
    client = client_factory()
    for step in (1, 2, 3):
        client.save_async(state(seed=step), root / f"step-{step}", step=step).result(30)
    wait_until(lambda: daemon.status()["mirror"]["uploaded"] == 3, timeout=60,
               what=lambda: f"three uploads (status: {daemon.status()['mirror']})")
    # the mirror's retention (--mirror-keep 2) runs after the third upload is counted
    mirrored = lambda: sorted({k.split("/")[1] for k in keys(s3, bucket, "mirror/")})  # noqa: E731
    wait_until(lambda: mirrored() == ["step-2", "step-3"], timeout=60,
               what=lambda: f"step-1 off the mirror: {mirrored()}")
    assert ckptd.load(ckptd.latest(f"s3://{bucket}/mirror"))["step"] == 3
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2", "step-3"]  # local retention is its own
    recent = daemon.status()["mirror"]["recent"][-1]
    assert recent["state"] == "uploaded" and recent["sent"] == recent["total"] > 0


def test_a_mirror_upload_retries_while_the_endpoint_is_down_and_shows_it(s3, bucket, daemon_factory, client_factory,
                                                                         root) -> None:
    metrics = root.parent / "metrics.prom"
    daemon = daemon_factory("--mirror", f"{root}=s3://{bucket}/mirror", "--metrics-textfile", str(metrics))
    client = client_factory()
    s3.stop()
    try:
        client.save_async(state(seed=1), root / "step-1", step=1).result(30)  # the local save does not wait
        wait_until(lambda: daemon.status()["mirror"]["retries"] >= 1, timeout=60, what="a failed attempt")
        upload = daemon.status()["mirror"]["uploads"][0]
        assert upload["state"] in ("retrying", "uploading") and f"endpoint {s3.url} unreachable" in upload["error"]
        assert ckptd.load(root / "step-1")["step"] == 1
    finally:
        s3.start()
    wait_until(lambda: daemon.status()["mirror"]["uploaded"] == 1, timeout=90, what="the upload after the retries")
    assert ckptd.load(f"s3://{bucket}/mirror/step-1")["step"] == 1
    assert "mirror: 1 uploaded, 0 failed" in daemon.cli("status").stdout
    wait_until(lambda: "ckptd_mirror_uploaded_total 1.0" in metrics.read_text(), what="the upload in the metrics")
    retries = next(line for line in metrics.read_text().splitlines() if line.startswith("ckptd_mirror_retries_total"))
    assert float(retries.split()[-1]) >= 1


def test_local_retention_keeps_a_checkpoint_whose_upload_has_not_finished(s3, bucket, daemon_factory, client_factory,
                                                                          root) -> None:
    (root / "run").mkdir()
    daemon = daemon_factory("--mirror", f"{root}/run=s3://{bucket}/mirror")
    client = client_factory()
    s3.stop()
    try:
        client.save_async(state(seed=1), root / "run" / "step-1", step=1).result(30)
        client.save_async(state(seed=2), root / "run" / "step-2", step=2, keep_last=1).result(30)
        # Retention runs in order on one maintenance thread: once this later pair's retention (not mirrored)
        # has deleted other/a, step-2's retention has run too, and it had to keep step-1 (upload retrying).
        (root / "other").mkdir()
        client.save_async(state(), root / "other" / "a", step=1).result(30)
        client.save_async(state(), root / "other" / "b", step=2, keep_last=1).result(30)
        wait_until(lambda: not (root / "other" / "a").exists(), what="retention in other/")
        assert (root / "run" / "step-1").exists()
    finally:
        s3.start()
    wait_until(lambda: daemon.status()["mirror"]["uploaded"] >= 2, timeout=90, what="step-1 and step-2 uploaded")
    assert ckptd.load(f"s3://{bucket}/mirror/step-1")["step"] == 1


def test_a_failed_save_removes_what_it_wrote_to_the_bucket(s3, bucket, daemon_factory, client_factory, root) -> None:
    daemon_factory("--root", f"s3://{bucket}")
    rank0 = client_factory(rank=0, world_size=2, commit_timeout=10.0)  # time to see rank 0's shard uploaded
    url = f"s3://{bucket}/run/step-1"
    fut = rank0.save_async(state(seed=1), url, step=1)
    wait_until(lambda: "run/step-1/rank-00000-of-00002.safetensors" in keys(s3, bucket), what="rank 0's shard uploaded")
    with pytest.raises(ckptd.RanksMissing):
        fut.result(30)  # rank 1 never commits
    wait_until(lambda: keys(s3, bucket, "run/") == [], what=lambda: f"run/ emptied, holds {keys(s3, bucket, 'run/')}")
    assert not s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads")
    rank0.close()
    client_factory().save_async(state(seed=2), url, step=2).result(30)  # the path is free again
    assert ckptd.load(url)["step"] == 2


def test_aws_config_files_fill_in_what_the_environment_leaves_unset(tmp_path, monkeypatch) -> None:
    from ckptd.protocol import objects

    (tmp_path / "config").write_text("[profile dev]\nregion = eu-west-1\nendpoint_url = http://127.0.0.1:9\n")
    (tmp_path / "credentials").write_text("[dev]\naws_access_key_id = AK\naws_secret_access_key = SK\n")
    for key in ("AWS_REGION", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_PROFILE", "dev")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "from-env")
    config = objects.store(f"cfg-{tmp_path.name}".lower()[:60]).config
    assert (config["region"], config["endpoint"], config["access_key_id"]) == ("eu-west-1", "http://127.0.0.1:9", "AK")
    assert "secret_access_key" not in config  # the environment's wins (obstore reads it there)


def test_sharded_state_with_global_tensors_saves_to_and_loads_from_s3(s3, bucket, daemon_factory, client_factory,
                                                                     root) -> None:
    """``replicated=`` keys are global tensors with a chunk table in the index, read back through the store."""
    daemon_factory("--root", f"s3://{bucket}")
    clients = [client_factory(rank=r, world_size=2) for r in (0, 1)]
    model = {"w": torch.arange(1024, dtype=torch.float32), "n": 4}
    url = f"s3://{bucket}/run/sharded"
    futures = [c.save_async({"model": model, "mine": torch.full((2,), r)}, url, replicated=("model",))
               for r, c in enumerate(clients)]
    for f in futures:
        f.result(60)
    assert sorted(ckptd.read_index(url).tensors) == ["model.w"]
    for r in (0, 1):
        target = {"model": {"w": torch.zeros(1024), "n": 0}, "mine": torch.zeros(2, dtype=torch.int64)}
        ckptd.load_into(target, url, rank=r)
        assert torch.equal(target["model"]["w"], model["w"]) and target["mine"].tolist() == [r, r]


def _latest_in_child(url: str, env: dict[str, str]) -> str:
    """``ckptd.latest(url)`` in a fresh process (its own stores and credentials): what it returned or raised."""
    code = ("import ckptd\ntry:\n    print('returned', ckptd.latest(%r))\n"
            "except Exception as e:\n    print('raised', type(e).__name__, e)" % url)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_latest_raises_when_the_store_cannot_be_listed_and_returns_none_only_for_an_empty_prefix(
        s3, bucket, daemon_factory, client_factory, root) -> None:
    daemon_factory("--root", f"s3://{bucket}")
    client_factory().save_async(state(seed=1), f"s3://{bucket}/run/step-1", step=1).result(30)
    env = {**os.environ, **s3.env}
    assert _latest_in_child(f"s3://{bucket}/empty", env).startswith("returned None")
    down = _latest_in_child(f"s3://{bucket}/run", {**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"})
    assert down.startswith(f"raised InvalidCheckpoint cannot list s3://{bucket}/run: endpoint http://127.0.0.1:"), down
    assert "unreachable" in down
    no_keys = {k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    anonymous = _latest_in_child(f"s3://{bucket}/run", {**no_keys, "HOME": "/nonexistent"})
    assert anonymous.startswith(f"raised InvalidCheckpoint cannot list s3://{bucket}/run: no usable AWS credentials"), \
        anonymous


@pytest.mark.parametrize("typo", ["S3://{b}/run/x", "gs://{b}/run/x", "s3a://{b}/run/x", "s3:{b}/run/x", "s3:/{b}/run/x"])
def test_a_misspelt_url_is_refused_everywhere_and_never_written_locally(typo, s3, bucket, daemon_factory,
                                                                       client_factory, root, tmp_path,
                                                                       monkeypatch) -> None:
    daemon = daemon_factory("--root", f"s3://{bucket}")
    monkeypatch.chdir(root)  # a typo taken as a relative path would land here
    url = typo.format(b=bucket)
    client = client_factory()
    with pytest.raises(ValueError, match="s3://bucket/prefix"):
        client.save_async(state(), url, step=1)
    for read in (ckptd.load, ckptd.latest, ckptd.read_index):
        with pytest.raises(ValueError, match="s3://bucket/prefix"):
            read(url)
    listed = daemon.cli("list", url)
    assert listed.returncode == 2 and "s3://bucket/prefix" in listed.stderr, listed
    assert list(root.iterdir()) == [] and keys(s3, bucket) == []


@pytest.mark.parametrize("name, error", [("run/q/../e3x", "segment '..'"), ("run/./e3x", "segment '.'"),
                                         ("run//e3x", "segment ''"), ("run/e\x013x", "control character")])
def test_an_object_name_the_store_refuses_is_a_value_error_at_the_call(name, error, s3, bucket, daemon_factory,
                                                                        client_factory, root) -> None:
    daemon = daemon_factory("--root", f"s3://{bucket}")
    url = f"s3://{bucket}/{name}"
    with pytest.raises(ValueError, match=f"path: .*{re.escape(error)}"):
        client_factory().save_async(state(), url, step=1)
    for command in (("verify", url), ("list", url)):
        refused = daemon.cli(*command)
        assert refused.returncode == 2 and error in refused.stderr, refused
    mirror = daemon.cli("start", "--root", str(root), "--mirror", f"{root}=s3://{bucket}/{name}")
    assert mirror.returncode == 2 and error in mirror.stderr, mirror
    assert keys(s3, bucket) == []


def test_an_endpoint_that_stops_mid_download_fails_the_load_naming_the_object(s3, bucket, daemon_factory,
                                                                            client_factory, root, monkeypatch) -> None:
    from ckptd.protocol import objects

    daemon_factory("--root", f"s3://{bucket}")
    url = f"s3://{bucket}/run/step-1"
    client_factory().save_async({"w": torch.ones(2**20)}, url, step=1).result(30)  # 4 MiB
    monkeypatch.setattr(objects, "READ_PART", 2**20)
    monkeypatch.setattr(objects, "PARALLEL_READS", 1)  # four ranged GETs, one at a time
    fetched = []
    real = objects.get_range

    def then_stop(*args, **kwargs):  # the real GET, then the endpoint goes away before the next one
        fetched.append(real(*args, **kwargs))
        s3.stop()
        return fetched[-1]

    monkeypatch.setattr(objects, "get_range", then_stop)
    try:
        with pytest.raises(InvalidCheckpoint, match=f"cannot read shard {url}/rank-00000-of-00001.safetensors: "
                                                    f"endpoint {s3.url} unreachable"):
            ckptd.load(url)
    finally:
        s3.start()
    assert len(fetched) == 1  # it failed part way, on the second request
    s3.client().delete_object(Bucket=bucket, Key="run/step-1/rank-00000-of-00001.safetensors")
    monkeypatch.setattr(objects, "get_range", real)
    with pytest.raises(InvalidCheckpoint, match=f"shard {url}/rank-00000-of-00001.safetensors is missing"):
        ckptd.load(url)


def test_a_spawned_daemon_takes_an_s3_root_from_ckptd_roots(s3, bucket, run_dir, root, monkeypatch) -> None:
    monkeypatch.setenv("CKPTD_ROOTS", f"{root}:s3://{bucket}/run")  # the ':' of s3:// is no separator
    client = ckptd.Client(run_dir=run_dir, spawn=True, timeout=20)
    pid = int((run_dir / "ckptd.pid").read_text())
    try:
        assert client.save_async(state(seed=1), f"s3://{bucket}/run/step-1", step=1).result(30).path == \
            f"s3://{bucket}/run/step-1"
        client.save_async(state(seed=2), root / "local", step=2).result(30)
        with pytest.raises(ckptd.PathNotAllowed, match=f"allowed roots \\(.*s3://{bucket}/run\\); to save there, "
                                                       f"start the daemon with --root s3://{bucket}/elsewhere"):
            client.save_async(state(seed=3), f"s3://{bucket}/elsewhere/x", step=3).result(30)
    finally:
        client.close()
        os.kill(pid, 15)
        wait_until(lambda: not Path(f"/proc/{pid}").exists(), timeout=60, what="the spawned daemon gone")
    assert ckptd.load(f"s3://{bucket}/run/step-1")["step"] == 1


@pytest.fixture
def two_rank_model(s3, bucket, daemon_factory, client_factory, root) -> tuple[str, torch.Tensor, dict[str, int]]:
    """A 4 MiB global tensor saved by two ranks beside 8 MiB of per-rank state each; (url, the tensor, shard sizes)."""
    daemon_factory("--root", f"s3://{bucket}")
    clients = [client_factory(rank=r, world_size=2) for r in (0, 1)]
    w = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(3))
    url = f"s3://{bucket}/run/sharded"
    futures = [c.save_async({"model": {"w": w}, "mine": torch.full((2**20,), r)}, url, replicated=("model",))
               for r, c in enumerate(clients)]
    for f in futures:
        f.result(60)
    sizes = {o["Key"].rsplit("/", 1)[-1]: o["Size"]
             for o in s3.client().list_objects_v2(Bucket=bucket, Prefix="run/sharded/")["Contents"]}
    return url, w, {name: size for name, size in sizes.items() if name.endswith(".safetensors")}


def _count_fetched(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes of every ranged GET from now on (the real GETs, counted)."""
    from ckptd.protocol import objects

    fetched, real = [], objects.get_range

    def counting(*args, **kwargs):
        data = real(*args, **kwargs)
        fetched.append(len(data))
        return data

    monkeypatch.setattr(objects, "get_range", counting)
    return fetched


def test_load_into_from_s3_fetches_only_the_ranges_the_targets_need(two_rank_model, monkeypatch) -> None:
    from ckptd.protocol.layout import HEADER_GUESS

    url, w, sizes = two_rank_model
    headers = 2 * HEADER_GUESS  # at most this much of each shard is fetched for its header
    for target in (torch.zeros(1024, 1024), torch.zeros(1024, 1024).t().contiguous().t()):  # contiguous, strided
        fetched = _count_fetched(monkeypatch)
        ckptd.load_into({"w": target}, url, key="model", strict=False, verify=False)
        assert torch.equal(target, w)
        assert w.nbytes <= sum(fetched) <= w.nbytes + headers  # not the 8 MiB of each rank's "mine"
    fetched = _count_fetched(monkeypatch)
    target = torch.zeros(1024, 1024)
    ckptd.load_into({"w": target}, url, key="model", strict=False)  # verified: each byte of the shard it reads, once
    assert torch.equal(target, w)
    shard = sizes["rank-00000-of-00002.safetensors"]  # rank 0 wrote the whole of w; rank 1's shard is not read
    assert shard <= sum(fetched) <= shard + headers


def test_a_damaged_replaced_or_missing_shard_object_fails_load_into_naming_it(s3, bucket, two_rank_model,
                                                                             monkeypatch) -> None:
    from ckptd.protocol import objects

    url, w, sizes = two_rank_model
    name = "rank-00000-of-00002.safetensors"  # the shard holding w
    key = f"run/sharded/{name}"
    data = bytearray(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    data[-5] ^= 0xFF  # one byte of the shard the load reads
    real, target = objects.get_range, {"w": torch.zeros(1024, 1024)}

    def replaced_first(*args, **kwargs):  # the object is replaced after the load opened it, before its first GET
        monkeypatch.setattr(objects, "get_range", real)
        s3.client().put_object(Bucket=bucket, Key=key, Body=bytes(data))
        return real(*args, **kwargs)

    monkeypatch.setattr(objects, "get_range", replaced_first)
    with pytest.raises(InvalidCheckpoint, match=f"cannot read shard {url}/{name}: the object changed while it was "
                                                "being read"):
        ckptd.load_into(target, url, key="model", strict=False)
    with pytest.raises(InvalidCheckpoint, match=f"shard {url}/{name} fails its checksum"):
        ckptd.load_into(target, url, key="model", strict=False)
    s3.client().delete_object(Bucket=bucket, Key=key)
    with pytest.raises(InvalidCheckpoint, match=f"shard {url}/{name} is missing"):
        ckptd.load_into(target, url, key="model", strict=False)


def test_export_reads_a_checkpoint_from_s3(s3, bucket, daemon_factory, client_factory, root, tmp_path) -> None:
    from safetensors.torch import load_file

    daemon = daemon_factory("--root", f"s3://{bucket}")
    url = f"s3://{bucket}/run/step-1"
    client_factory().save_async(state(200_000, 1), url, step=1).result(30)
    exported = daemon.cli("export", url, str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(tensors) == ["b", "w"] and torch.equal(tensors["w"], state(200_000, 1)["w"])


def test_store_failures_read_as_sentences_and_say_what_to_check(s3, bucket, daemon_factory, monkeypatch) -> None:
    from ckptd.protocol.objects import os_error

    monkeypatch.delenv("AWS_ENDPOINT_URL")  # AWS's own endpoint
    unreachable = os_error(OSError("error sending request: dns error"), f"s3://{bucket}/x")
    assert unreachable.strerror.startswith(f"the AWS S3 endpoint unreachable for bucket '{bucket}'"), unreachable
    denied = os_error(Exception("AccessDenied: Access Denied"), f"s3://{bucket}/x")
    assert "check the credentials in use and the bucket policy" in denied.strerror
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.url)
    listed = daemon_factory().cli("list", f"s3://{bucket}-missing/run")
    assert listed.returncode == 3, listed
    assert listed.stderr == f"ckptd: s3://{bucket}-missing/run: bucket '{bucket}-missing' does not exist\n", listed


def test_latest_raises_rather_than_skip_a_checkpoint_whose_index_the_store_failed_to_return(
        s3, bucket, daemon_factory, client_factory, monkeypatch) -> None:
    from ckptd.protocol import objects

    daemon_factory("--root", f"s3://{bucket}")
    client = client_factory()
    for step in (1, 2):
        client.save_async(state(seed=step), f"s3://{bucket}/run/step-{step}", step=step).result(30)
    real = objects.read_all

    def failing_once(path):  # the store fails the newest index's GET once (a timeout while retention deletes)
        if str(path).endswith("step-2/ckptd.json") and not failed:
            failed.append(path)
            raise objects.os_error(OSError("error sending request: operation timed out"), path)
        return real(path)

    failed: list = []
    monkeypatch.setattr(objects, "read_all", failing_once)
    with pytest.raises(ckptd.InvalidCheckpoint, match="cannot read .*step-2/ckptd.json"):
        ckptd.latest(f"s3://{bucket}/run")  # never the older step-1
    assert failed and ckptd.latest(f"s3://{bucket}/run") == f"s3://{bucket}/run/step-2"


def test_inspect_and_verify_of_an_object_name_it_by_its_url(s3, bucket, daemon_factory, client_factory) -> None:
    from ckptd.protocol.inspect import inspect_checkpoint, verify_checkpoint

    daemon_factory("--root", f"s3://{bucket}")
    url = f"s3://{bucket}/run/step-1"
    client_factory().save_async(state(seed=1), url, step=1).result(30)
    assert inspect_checkpoint(url).path == url and inspect_checkpoint(Path(url)).path == url
    report = verify_checkpoint(url)
    assert report.ok and report.path == url


def test_a_bucket_alone_is_no_checkpoint_name_and_the_error_says_what_is(s3, bucket, daemon_factory,
                                                                         client_factory) -> None:
    daemon_factory("--root", f"s3://{bucket}/run")
    with pytest.raises(ckptd.PathNotAllowed, match=r"named s3://BUCKET/NAME \(a bucket is no checkpoint\)"):
        client_factory().save_async(state(seed=1), f"s3://{bucket}", step=1).result(30)


def test_client_delete_on_the_store_deletes_a_checkpoint_and_leaves_what_is_none(s3, bucket, daemon_factory,
                                                                                client_factory, root) -> None:
    """On a store a prefix is only its objects: stray objects without an index are something there, which is
    named and left (it was reported deleted), and a committed checkpoint goes whole."""
    daemon_factory("--root", f"s3://{bucket}")
    client = client_factory()
    url = f"s3://{bucket}/runs/step-1"
    client.save_async(state(seed=1), url, step=1).result(30)
    s3.client().put_object(Bucket=bucket, Key="runs/stray/data.bin", Body=b"mine")
    with pytest.raises(InvalidCheckpoint, match=f"not a committed ckptd checkpoint: it has no {INDEX_NAME}"):
        client.delete(f"s3://{bucket}/runs/stray")
    client.delete(url)
    assert keys(s3, bucket) == ["runs/stray/data.bin"]
    assert ckptd.latest(f"s3://{bucket}/runs") is None
