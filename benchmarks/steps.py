"""Step-time cost of a save, per integration: a memory snapshot, a persisted save, the framework's own async save.

A trainer pays for a save in its training steps, not in a save call alone: the step that saves is longer by what the
call blocks, and the steps after it may be longer while the save writes beside them. So each integration trains a
small model (``Trainee``: an MLP and its AdamW state, a few hundred MiB at default size) on the CPU, saving every
``every`` steps, and each step is timed from its start to the next one's (the save inside it, and the wait a save
makes for the previous one, included). Per way of saving, one value per save: ``<mode>_step``, the step that saved,
and ``<mode>_interval``, the ``every`` steps ending with it; ``none_step`` holds every step of a run that never saves.
The report subtracts: step cost = median ``<mode>_step`` - median ``none_step``, interval cost = median
``<mode>_interval`` - ``every`` × median ``none_step``. All modes of an integration run in one process, one after
another, so their ratios are of one run's figures.

Only torch is imported here: ``torchtitan_steps`` (run in ``.venv-torchtitan``) uses the same trainee and loop.
"""
from __future__ import annotations
import time
from typing import Any, Callable
import torch
from torch import nn

LAYERS = 4
"""Few and wide: through a deep stack of ReLU layers the activations and gradients shrink towards denormal floats,
which the CPU computes 10-100 × slower (21 layers of 1024 took 3-5 s a step, drifting as they shrank)."""
WIDTH_STEP = 64
BATCH = 8
BYTES_PER_PARAM = 12
"""float32 parameter + AdamW exp_avg + exp_avg_sq."""
MODES = ("warmup", "none", "snapshot", "persisted", "own")
"""In the order they run; ``warmup`` (a ``none`` run, not recorded) pays the process's first steps' costs (lazy
initialisation, allocator growth), which would otherwise fall on whichever mode ran first."""
QUIET = ("warmup", "none")
"""The modes that never save."""

class Trainee:
    """An MLP of ``LAYERS`` square layers, their width sized to ``size_gib`` of state (with AdamW's), and one batch
    to train on. Denormals are flushed to zero (``torch.set_flush_denormal``) so that no step slows as values
    shrink: the steps of every mode cost the same."""
    def __init__(self, size_gib: float, seed: int = 0, device: str = "cpu") -> None:
        torch.manual_seed(seed)
        torch.set_flush_denormal(True)
        width = max(WIDTH_STEP, round((size_gib * (1 << 30) / BYTES_PER_PARAM / LAYERS) ** 0.5 / WIDTH_STEP)
                    * WIDTH_STEP)
        self.model = nn.Sequential(*(m for _ in range(LAYERS) for m in (nn.Linear(width, width), nn.ReLU()))
                                   ).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x, self.y = torch.randn(BATCH, width, device=device), torch.randn(BATCH, width, device=device)
    def loss(self, model: nn.Module | None = None) -> torch.Tensor:
        return nn.functional.mse_loss((model or self.model)(self.x), self.y)
    def step(self) -> None:
        """One training step: forward, backward, AdamW."""
        self.optimizer.zero_grad(set_to_none=True)
        self.loss().backward()
        self.optimizer.step()
    @property
    def nbytes(self) -> int:
        """Parameters and optimizer state (after the first step made it)."""
        tensors = [*self.model.parameters(), *(t for s in self.optimizer.state.values() for t in s.values()
                                               if isinstance(t, torch.Tensor))]
        return sum(t.numel() * t.element_size() for t in tensors)

def train(step: Callable[[], None], save: Callable[[int], Any] | None, *, every: int, saves: int,
          wait: Callable[[Any], None] = lambda handle: None) -> dict[str, list[float]]:
    """``every`` × (1 + ``saves``) timed steps, the last of each ``every`` calling ``save(step)`` (None: never), the
    first ``every`` a warm-up (the first save makes slots, threads, files). A save's handle is passed to ``wait``
    before the next save (a trainer waits for the previous async save there) and after the last step.

    Returns ``step`` (each saving step; every step where ``save`` is None) and ``interval`` (each ``every`` steps
    ending with a save), after the warm-up."""
    times, handle = [], None
    for i in range(1, 1 + every * (1 + saves)):
        t0 = time.perf_counter()
        step()
        if save is not None and i % every == 0:
            if handle is not None:
                wait(handle)
            handle = save(i)
        times.append(time.perf_counter() - t0)
    if handle is not None:
        wait(handle)
    return step_times(times, every=every, saves=saves, saving=save is not None)

def step_times(between_starts: list[float], *, every: int, saves: int, saving: bool) -> dict[str, list[float]]:
    """``train``'s figures from a framework's own loop: ``between_starts[i]`` is step ``i + 1``'s time (from its
    start to the next step's, so its checkpoint callbacks are in it); saves at every ``every``-th step."""
    timed = between_starts[every:every * (1 + saves)]
    intervals = [sum(timed[j:j + every]) for j in range(0, len(timed), every)]
    return {"step": timed[every - 1::every] if saving else timed, "interval": intervals}

def record(reps: dict[str, list[float]], mode: str, figures: dict[str, list[float]]) -> None:
    """``figures`` of one mode into the case's ``reps`` as ``<mode>_step`` and ``<mode>_interval`` (none of the
    warm-up's)."""
    if mode == "warmup":
        return
    for key, values in figures.items():
        reps[f"{mode}_{key}"] = values
