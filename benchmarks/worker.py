"""One measurement in a fresh process, driven by the orchestrator over pipes.

``python -m benchmarks.worker '{"task": "...", "args": {...}}'``

A worker builds what it needs (usually the state dict), says ``ready``, and
waits for ``go`` on stdin: the orchestrator starts the timed part only when
the machine is quiet and its sampler is watching this process. The worker
then sends time marks (``CLOCK_MONOTONIC``, the same clock in every
process), asks the sampler to watch helper processes (DCP's checkpoint
process), and finally sends its ``result`` as one JSON line.

The protocol runs on a private copy of the original stdout; file descriptor
1 is pointed at stderr (the worker's log file), so that nothing a library
or a child process prints can corrupt it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from typing import Any, Callable

TASKS: dict[str, str] = {
    # task name -> "module:function", imported lazily (the orchestrator never runs these)
    "limits": "benchmarks.save:task_limits",
    "torch_save": "benchmarks.save:task_torch_save",
    "dcp": "benchmarks.save:task_dcp",
    "ckptd": "benchmarks.save:task_ckptd",
    "scaling": "benchmarks.scaling:task_scaling",
    "raw_write": "benchmarks.multi:task_raw_write",
    "saver": "benchmarks.multi:task_saver",
    "load_prepare": "benchmarks.loading:task_prepare",
    "load_method": "benchmarks.loading:task_method",
    "rank_loader": "benchmarks.loading:task_rank_loader",
    "dry": "benchmarks.worker:task_dry",
}


class Channel:
    """The worker's end of the pipes to the orchestrator."""

    def __init__(self) -> None:
        proto = os.dup(1)
        os.dup2(2, 1)  # library and child-process output goes to the log
        sys.stdout = sys.stderr
        self._out = os.fdopen(proto, "w", buffering=1)
        self._in = sys.stdin

    def send(self, event: str, **data: Any) -> None:
        self._out.write(json.dumps({"event": event, **data}) + "\n")
        self._out.flush()

    def mark(self, name: str) -> float:
        t = time.monotonic()
        self.send("mark", name=name, t=t)
        return t

    def watch(self, role: str, pid: int) -> None:
        """Ask the sampler to watch ``pid`` as ``role`` (a writer process, say)."""
        self.send("watch", role=role, pid=pid)

    def ready(self, **data: Any) -> None:
        """Say ready and block until the orchestrator says go (exit on stop)."""
        self.send("ready", **data)
        line = self._in.readline()
        if line.strip() != "go":
            raise SystemExit(0)


def task_dry(ch: Channel, **args: Any) -> dict:
    """A no-op task, for checking the protocol itself."""
    ch.ready()
    ch.mark("steady")
    ch.mark("end")
    return {"args": args}


def main() -> int:
    spec = json.loads(sys.argv[1])
    ch = Channel()
    module, func = TASKS[spec["task"]].split(":")
    fn: Callable[..., dict] = getattr(importlib.import_module(module), func)
    try:
        result = fn(ch, **spec.get("args", {}))
    except SystemExit:
        raise
    except BaseException as exc:
        traceback.print_exc()
        ch.send("error", error=f"{type(exc).__name__}: {exc}")
        return 1
    ch.send("result", **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
