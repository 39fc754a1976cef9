"""``aioload bench --plot FILE``: img/s and the consumer's waiting, per loader and scenario.

matplotlib is an optional dependency (``pip install 'aioload[plot]'``), imported only here.
"""

from __future__ import annotations

import os

FORMATS = (".png", ".svg")
PLOT_MISSING = "--plot needs matplotlib, which is not installed: pip install 'aioload[plot]'"
COLOURS = {"torch DataLoader": "#7f7f7f", "aioload DataLoader": "#1f77b4"}


def check(path: str) -> str | None:
    """Why ``path`` cannot be drawn (a message naming the fix), or ``None``."""
    if os.path.splitext(path)[1].lower() not in FORMATS:
        return f"--plot {path}: the file must end in .png or .svg"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return PLOT_MISSING
    return None


def plot(path: str, scenarios) -> None:
    """Two panels side by side: median img/s (with the ceiling, where measured) and the median
    time the consumer waited for each batch; one group of bars per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    names = list(COLOURS)
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    rate_ax, wait_ax = fig.subplots(1, 2)
    width = 0.38
    for ax, attr, title in ((rate_ax, "rate", "images per second after the first batch (higher is better)"),
                            (wait_ax, "wait_ms_per_batch", "consumer waited, ms per batch (lower is better)")):
        for k, name in enumerate(names):
            xs = [i + (k - 0.5) * width for i in range(len(scenarios))]
            values = [s.comparison.med(name, attr) for s in scenarios]
            bars = ax.bar(xs, values, width, label=name.replace(" DataLoader", ""), color=COLOURS[name])
            ax.bar_label(bars, fmt="%.0f", fontsize=8, padding=2)
        ax.set_xticks(range(len(scenarios)), [s.title for s in scenarios])
        ax.set_title(title, fontsize=10)
        ax.margins(y=0.15)
    for i, s in enumerate(scenarios):
        if s.ceiling:
            rate_ax.hlines(s.ceiling, i - width, i + width, colors="black", linestyles="dashed",
                           label="ceiling (decode alone)")
    handles, labels = rate_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize=8)
    fig.suptitle("aioload bench: medians of the interleaved rounds", fontsize=11)
    fig.savefig(path)
