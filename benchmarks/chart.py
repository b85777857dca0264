"""``results.png``: blocking and durable time per save method (and load times), with matplotlib.

matplotlib is optional: without it the run writes no chart and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .loading import LoadSection
    from .save import SaveSection


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def draw(path: Path, save: "SaveSection | None", load: "LoadSection | None") -> bool:
    """Write the chart to ``path``; False if matplotlib is missing or there is nothing to draw."""
    if not available() or (save is None and load is None):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in (save, load) if p is not None]
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 6.2), squeeze=False)
    col = 0
    if save is not None:
        ax = axes[0][col]
        col += 1
        names = [m.what.replace("ckptd save_async, ", "ckptd ").replace(" + reused DefaultStager", "\n+ reused stager")
                 for m in save.methods]
        y = range(len(save.methods))
        blocking = [m.returned.median for m in save.methods]
        staged = [m.staged.median for m in save.methods]
        durable = [m.durable.median for m in save.methods]
        h = 0.27
        ax.barh([i - h for i in y], blocking, h, label="blocking (call returned)", color="#d62728")
        ax.barh(list(y), staged, h, label="staged (tensors may change)", color="#ff9896")
        ax.barh([i + h for i in y], durable, h, label="durable", color="#1f77b4")
        ax.axvline(save.memcpy.median, color="#d62728", ls="--", lw=1, label="memcpy into reused buffer")
        ax.axvline(save.direct.median, color="#1f77b4", ls="--", lw=1, label="raw O_DIRECT write + fsync")
        ax.set_yticks(list(y))
        ax.set_yticklabels(names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("seconds (log scale)")
        ax.set_title(f"Saving a {save.nbytes / (1 << 30):.2f} GiB state (median)")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.11), ncol=3, frameon=False)
        ax.grid(axis="x", which="both", alpha=0.3)
    if load is not None:
        ax = axes[0][col]
        rows = []
        for m in load.methods:
            rows.append((m.what, m.cold.median if m.cold else None, m.warm.median if m.warm else None))
            if m.cold_touch or m.warm_touch:
                rows.append((f"{m.what}\n+ sum over every tensor", m.cold_touch.median if m.cold_touch else None,
                             m.warm_touch.median if m.warm_touch else None))
        y = range(len(rows))
        h = 0.38
        ax.barh([i - h / 2 for i in y], [r[1] or 0 for r in rows], h, label="cold page cache", color="#2ca02c")
        ax.barh([i + h / 2 for i in y], [r[2] or 0 for r in rows], h, label="warm page cache", color="#98df8a")
        ax.set_yticks(list(y))
        ax.set_yticklabels([r[0] for r in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("seconds (log scale)")
        ax.set_title(f"Loading a {load.nbytes / (1 << 30):.2f} GiB state (median)")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.11), ncol=2, frameon=False)
        ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
