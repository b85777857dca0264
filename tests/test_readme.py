"""Every fenced code block of README.md and docs/*.md runs (or, where it shows a layout, is checked) in
``make test``.

How a block runs follows from its info string and its first line, never from a list of exceptions:

* ``python``: a script in its own interpreter. A first line ``# given: a, b (c)`` names what the
  snippet takes from the program around it (a model, a client...); the runner defines exactly those
  (``GIVEN``) before the block and closes them after it. ``under torchrun`` runs the script with
  ``torchrun --standalone --nproc-per-node 2`` (gloo on CPU). ``runs=N`` in the info string runs it N
  times: a block that resumes from what it saved then runs its resume path too.
* ``sh``/``bash``: a ``bash -e`` script from the repository root, with the venv's commands on PATH;
  ``make TARGET`` lines are dry runs (``make -n``), since ``make test`` would run itself.
* ``text diagram``: a picture; each ``dir/file.py`` it names exists in the repository, and it names at
  least one (so a picture of the pipeline cannot outlive the modules it shows).
* ``text tree=repo``: a layout of the repository; each top-level directory it names exists, and each
  ``file.py`` named in a directory's description exists in that directory.
  ``text tree=checkpoint``: a checkpoint ``p/``; the files it lists are exactly those of a committed one.
* ``json``: valid JSON; its ``tensors`` equal the index of a checkpoint saved with those tensors.

The pages' example locations (``/ckpts``, ``/models``, ``s3://my-bucket``) become directories under
the test's temporary directory and a bucket on a local S3 endpoint (``tests/s3server.py``), and
``CKPTD_RUN_DIR``/``CKPTD_ROOTS`` (docs/api.md, README: torchrun) point clients at the test's daemon. Blocks
run in order, README.md first, then docs/*.md by name, and share those directories and the bucket, so a
later block reads what an earlier one saved (``ckptd verify`` of the torchrun example's checkpoint, the
object-storage page's ``ckptd list`` of the README's save to the bucket). Each block gets a daemon of its own,
started by the test (roots: the directory and the bucket) unless the block starts one itself
(``ckptd start``); either is stopped after the block, and must stop cleanly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest
import torch

import ckptd
from helpers import REPO, short_tempdir, start_daemon
from s3server import S3Server

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
"""Every page whose blocks run, in the order they run."""
BLOCK_TIMEOUT_S = 400
"""Generous: two torchrun runs of an example on a loaded two-core machine take about a minute."""


@dataclass(frozen=True)
class Given:
    """What a snippet takes from its surroundings: code that defines it, and code that closes it after."""

    setup: str = ""
    teardown: str = ""
    torchrun: bool = False


_LIGHTNING_MODEL = '''
import torch
import lightning.pytorch as pl


class TinyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def train_dataloader(self):
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


model = TinyModule()
'''

_FSDP2 = '''
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model(torch.randn(4, 16)).sum().backward()
optimizer.step()
'''

GIVEN: dict[str, Given] = {
    "model": Given("import torch\n"
                   "model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))\n"),
    "optimizer": Given("optimizer = torch.optim.AdamW(model.parameters())\n"),
    "train_step": Given("def train_step():\n"
                        "    x = torch.randn(32, 16)\n"
                        "    (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean().backward()\n"
                        "    with torch.no_grad():\n"
                        "        for p in model.parameters():\n"
                        "            p -= 0.01 * p.grad\n"
                        "            p.grad = None\n"),
    "steps": Given("steps = 1001\n"),
    "step": Given("step = 9000\n"),
    "path": Given('path = "/ckpts/fsdp-snippet/step-9000"\n'),
    "client": Given("import ckptd\nclient = ckptd.Client()\n", "client.close()\n"),
    "model (a LightningModule)": Given(_LIGHTNING_MODEL),
    "model and optimizer (FSDP2)": Given(_FSDP2, "dist.destroy_process_group()\n"),
    "under torchrun": Given(torchrun=True),
}
"""Every name a snippet may take as given (its ``# given:`` line), defined here once."""


@dataclass
class Block:
    page: str
    line: int
    lang: str
    attrs: dict[str, str]
    text: str

    @property
    def id(self) -> str:
        return f"{self.page}:line{self.line}-{self.lang}"

    @property
    def script(self) -> str:
        """A file name for the block's script (its id, with the page's directories flattened)."""
        return re.sub(r"[^\w.-]", "-", self.id)

    @property
    def where(self) -> str:
        """Where the block is, as an error message names it."""
        return f"{self.page} line {self.line}"

    def given(self) -> list[str]:
        first = self.text.splitlines()[0] if self.text.strip() else ""
        if not first.startswith("# given:"):
            return []
        return [name.strip() for name in first.removeprefix("# given:").split(",")]


def page_blocks(page: str, text: str) -> list[Block]:
    """Every fenced block of a page, with its language, ``key=value`` attributes and bare words (``diagram``)
    from the info string."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^```(.*)$", lines[i])
        if opening is None:
            i += 1
            continue
        words = opening.group(1).split()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and lines[i] != "```":
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{page} line {start}: a fenced block that never closes"
        lang = words[0] if words else ""
        attrs = dict(w.split("=", 1) if "=" in w else (w, "") for w in words[1:])
        blocks.append(Block(page, start, lang, attrs, "\n".join(body) + "\n"))
        i += 1
    return blocks


BLOCKS = [b for page in PAGES for b in page_blocks(str(page.relative_to(REPO)), page.read_text())]


@dataclass
class Scene:
    """Where the pages' examples live in this test: directories, the bucket, the environment."""

    base: Path
    bucket: str
    s3: S3Server
    env: dict[str, str] = field(default_factory=dict)

    def localize(self, text: str) -> str:
        """The pages' locations mapped to this test's (``/ckpts`` -> ``<base>/ckpts``, the bucket)."""
        text = re.sub(r"(?<![\w./-])/(ckpts|models)(?=[/\s\"'`]|$)", lambda m: f"{self.base}/{m.group(1)}", text)
        return text.replace("s3://my-bucket", f"s3://{self.bucket}")


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    base = tmp_path_factory.mktemp("readme")
    for d in ("ckpts", "models", "work", "blocks"):
        (base / d).mkdir()
    s3 = S3Server()
    s3.start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for key, value in s3.env.items():
                mp.setenv(key, value)  # for the daemons start_daemon starts, and this process's reads
            scene = Scene(base, s3.new_bucket(), s3)
            bin_dir = str(Path(sys.executable).parent)
            scene.env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                             CKPTD_ROOTS=f"{base}/ckpts:s3://{scene.bucket}")
            yield scene
    finally:
        s3.stop()


def run_python(block: Block, scene: Scene, env: dict[str, str]) -> str:
    names = block.given()
    unknown = [n for n in names if n not in GIVEN]
    assert not unknown, f"{block.where}: nothing defines given {unknown}; GIVEN has {sorted(GIVEN)}"
    given = [GIVEN[n] for n in names]
    script = "".join(g.setup for g in given) + block.text + "".join(g.teardown for g in reversed(given))
    path = scene.base / "blocks" / f"{block.script}.py"
    path.write_text(scene.localize(script))
    if any(g.torchrun for g in given):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(path)]
    else:
        cmd = [sys.executable, str(path)]
    output = ""
    for _ in range(int(block.attrs.get("runs", "1"))):
        done = subprocess.run(cmd, cwd=scene.base / "work", env=env, capture_output=True, text=True,
                              timeout=BLOCK_TIMEOUT_S)
        output += done.stdout + done.stderr
        assert done.returncode == 0, f"{block.where} exited {done.returncode}:\n{output[-6000:]}"
    return output


def run_shell(block: Block, scene: Scene, env: dict[str, str]) -> str:
    text = re.sub(r"^(\s*)make (?!-n)", r"\1make -n ", block.text, flags=re.M)
    path = scene.base / "blocks" / f"{block.script}.sh"
    path.write_text("set -euo pipefail\n" + scene.localize(text))
    done = subprocess.run(["bash", str(path)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT_S)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{block.where} exited {done.returncode}:\n{output[-6000:]}"
    return output


def check_diagram(block: Block) -> None:
    named = re.findall(r"\b[\w]+/[\w/]*\w+\.py\b", block.text)
    assert named, f"{block.where}: a diagram naming no module (dir/file.py)"
    missing = sorted({n for n in named if not (REPO / n).is_file()})
    assert not missing, f"{block.where} names {missing}, which the repository lacks"


def check_tree(block: Block, scene: Scene) -> None:
    lines = [line for line in block.text.splitlines() if line.strip()]
    if block.attrs.get("tree") == "repo":  # each top-level directory, and each file.py its description names
        named: list[str] = []
        top = ""
        for line in lines:
            if not line[0].isspace():
                top = line.split()[0]
                named.append(top)
            named += [top + f for f in re.findall(r"\b[\w/]+\.py\b", line if line[0].isspace() else line[len(top):])]
        assert named, f"{block.where}: a repository layout naming nothing"
        missing = [n for n in named if not (REPO / n).exists()]
        assert not missing, f"{block.where} names {missing}, which the repository lacks"
        return
    assert block.attrs.get("tree") == "checkpoint", \
        f"{block.where}: text needs diagram, tree=repo or tree=checkpoint"
    assert lines[0].split()[0] == "p/", f"{block.where}: a checkpoint layout starts at p/"
    listed = sorted(line.split()[0] for line in lines[1:])
    path = scene.base / "ckpts" / "layout" / "p"
    with ckptd.Client(spawn=False, timeout=30.0) as client:
        client.save_async({"w": torch.zeros(3)}, path).result(60)
    assert sorted(os.listdir(path)) == listed


def check_json(block: Block, scene: Scene) -> None:
    doc = json.loads(block.text)
    tensors = doc["tensors"]
    state: dict = {}
    for name, record in tensors.items():
        *parents, leaf = name.split(".")
        node = state
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = torch.zeros(record["shape"], dtype=torch.float32 if record["dtype"] == "F32" else None)
    path = scene.base / "ckpts" / "index-example" / "p"
    with ckptd.Client(spawn=False, timeout=30.0) as client:
        client.save_async(state, path, replicated=tuple(state)).result(60)
    index = json.loads((path / "ckptd.json").read_text())
    assert index["tensors"] == tensors


AFTER: dict[str, str] = {
    'trainer(4).fit(model, ckpt_path="last")': "Restored all states from the checkpoint",
    "--ckpt-dir /ckpts/run1 --steps 300": "resumed from step 200",
    "--ckpt-dir /ckpts/fabric --steps 8": "resumed from step 6",
}
"""Blocks that claim a resume, and what their output shows when the resume happened."""


@pytest.mark.timeout(BLOCK_TIMEOUT_S * 2 + 60)
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs(block: Block, scene: Scene) -> None:
    if block.lang not in ("python", "sh", "bash", "text", "json"):
        pytest.fail(f"{block.where}: a block in {block.lang or 'no language'}; the runner runs python, sh and "
                    "bash, and checks text diagram, text tree=repo|checkpoint and json")
    if block.lang == "text" and "diagram" in block.attrs:
        check_diagram(block)  # a picture: nothing runs, so no daemon
        return
    run_dir = short_tempdir("ckreadme-")
    env = dict(scene.env, CKPTD_RUN_DIR=str(run_dir))
    starts_own = block.lang in ("sh", "bash") and "ckptd start" in block.text
    daemon = None
    if not starts_own:
        daemon = start_daemon(run_dir, scene.base / "ckpts", "--root", f"s3://{scene.bucket}")
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("CKPTD_RUN_DIR", str(run_dir))  # for the checks this process makes
            if block.lang == "python":
                output = run_python(block, scene, env)
            elif block.lang in ("sh", "bash"):
                output = run_shell(block, scene, env)
            elif block.lang == "text":
                output = ""
                check_tree(block, scene)
            else:
                output = ""
                check_json(block, scene)
        for claim, shown in AFTER.items():
            if claim in block.text:
                assert shown in output, f"{block.where} did not show {shown!r}:\n{output[-6000:]}"
    finally:
        if daemon is not None:
            assert daemon.stop(60) == 0, "the test's daemon did not stop cleanly"
        else:
            stopped = subprocess.run([sys.executable, "-m", "ckptd", "stop", "--run-dir", str(run_dir)],
                                     capture_output=True, text=True, timeout=120, env=env)
            assert stopped.returncode in (0, 1), stopped.stderr  # 1: the block stopped it itself
        shutil.rmtree(run_dir, ignore_errors=True)


def test_every_given_name_is_used_by_some_block() -> None:
    """``GIVEN`` holds nothing the pages no longer ask for (one place for each fact)."""
    used = {name for block in BLOCKS for name in block.given()}
    assert used == set(GIVEN)
