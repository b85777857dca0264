"""A process's random generators as a state ckptd saves, and back: for the integrations whose frameworks save them.

The Hugging Face ``Trainer`` (``rng_state.pth``) and accelerate (``random_states_N.pkl``) pickle each process's
Python, numpy, torch and accelerator generators, so a resumed run draws the same dropout masks and shuffles as the
uninterrupted one. ckptd pickles nothing: these functions give the same generators as plain values and tensors (the
numpy key array as a list of ints), under the keys ``python``, ``numpy``, ``cpu`` and the accelerator's device type
(``cuda``, ``xpu``, ...: every device's generator of that type).

numpy is the frameworks' own dependency, not ckptd's: it is taken from ``sys.modules``, where they imported it.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

__all__ = ["capture", "restore"]

_HOST = ("python", "numpy", "cpu")


def _numpy() -> Any:
    return sys.modules["numpy"]


def capture(device_type: str | None = None) -> dict[str, Any]:
    """This process's generators; ``device_type`` (default: ``cuda`` where CUDA is available) adds that
    accelerator's (``cpu`` and ``None`` add none)."""
    kind, keys, pos, has_gauss, cached = _numpy().random.get_state()
    states: dict[str, Any] = {"python": random.getstate(),
                              "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos),
                                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
                              "cpu": torch.random.get_rng_state()}
    if device_type is None and torch.cuda.is_available():
        device_type = "cuda"
    if device_type is not None and device_type != "cpu":
        module = torch.get_device_module(device_type)
        states[device_type] = (module.get_rng_state_all() if hasattr(module, "get_rng_state_all")
                               else module.get_rng_state())
    return states


def restore(states: dict[str, Any]) -> None:
    """Set this process's generators to ``states`` (from :func:`capture`); an accelerator's is set where this
    process has that accelerator."""
    python = states["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    n, np = states["numpy"], _numpy()
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.random.set_rng_state(states["cpu"])
    for device_type, state in states.items():
        if device_type in _HOST:
            continue
        module = getattr(torch, device_type, None)
        if module is None or not module.is_available():
            continue
        if isinstance(state, (list, tuple)):
            module.set_rng_state_all(state)
        else:
            module.set_rng_state(state)
