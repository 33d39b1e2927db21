"""The simulated timeline as a Gantt chart: one row per lane, one panel per strategy."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .engine import CODEC, COMPUTE, CPU, INTER, INTRA, NETWORK, Result

_LANES = (COMPUTE, CODEC, CPU, NETWORK, INTRA, INTER)
_COLORS = {
    "forward": "#8172b2",
    "backward": "#4c72b0",
    "optimizer": "#937860",
    "compress": "#dd8452",
    "decompress": "#c44e52",
}
_TRANSFER_COLOR = "#55a868"


def draw(results: Sequence[Result], path: str | Path, title: str = "") -> Path:
    """Write one panel per result (worker 0 and its node's links) to a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no screen
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    heights = [len(_used_lanes(r)) * 0.35 + 0.9 for r in results]
    fig, axes = plt.subplots(
        len(results),
        1,
        figsize=(10, sum(heights) + 0.6),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    end = max(r.step_s for r in results)
    for ax, result in zip(axes[:, 0], results, strict=True):
        lanes = _used_lanes(result)
        for span in result.spans:
            row = lanes.index(span.lane)
            color = _COLORS.get(span.label, _TRANSFER_COLOR)
            ax.barh(
                row,
                span.end_s - span.start_s,
                left=span.start_s,
                height=0.7,
                color=color,
                edgecolor="white",
                linewidth=0.3,
            )
        ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, end * 1.02)
        ax.axvline(result.step_s, color="black", linewidth=0.8)
        ax.set_title(
            f"{result.strategy}: step {result.step_s * 1e3:.1f} ms, scaling {result.scaling:.2f}",
            fontsize=9,
            loc="left",
        )
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds from the start of the step (worker 0)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _used_lanes(result: Result) -> list[str]:
    used = {span.lane for span in result.spans}
    return sorted(used, key=lambda lane: (_LANES.index(lane.split()[0]), lane))
