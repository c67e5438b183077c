"""The time breakdown drawn: every step of every rank as a stacked bar of its parts, in a self-contained HTML page
(inline SVG, no script, nothing fetched) or a PNG (matplotlib, the optional `plot` extra)."""

from __future__ import annotations

import html
import math
import os
from typing import Any

from torchloom.errors import MisuseError

_COLOURS = {
    "data": "#8c564b",
    "forward": "#1f77b4",
    "backward": "#ff7f0e",
    "communication": "#d62728",
    "optimizer": "#2ca02c",
    "torchloom": "#9467bd",
    "other": "#c7c7c7",
}


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def _svg(
    steps: list[dict[str, float]], parts: tuple[str, ...], top: float, width: int = 720, height: int = 180
) -> str:
    left, bottom = 56, 22
    plot_w, plot_h = width - left - 8, height - bottom - 8
    bar = plot_w / max(len(steps), 1)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">']
    for tick in range(5):
        value = top * tick / 4
        y = 8 + plot_h - plot_h * tick / 4
        out.append(f'<line x1="{left}" x2="{width - 8}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(
            f'<text x="{left - 4}" y="{y + 4:.1f}" font-size="10" text-anchor="end">{value * 1e3:.1f} ms</text>'
        )
    for index, row in enumerate(steps):
        y = 8 + plot_h
        x = left + index * bar
        for part in parts:
            h = plot_h * _finite(row.get(part, 0.0)) / top if top else 0.0
            if h <= 0:
                continue
            y -= h
            tip = f"step {index}: {part} {row[part] * 1e3:.3f} ms of {row['step'] * 1e3:.3f} ms"
            out.append(
                f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(bar - 1, 0.5):.2f}" height="{h:.2f}" '
                f'fill="{_COLOURS[part]}"><title>{html.escape(tip)}</title></rect>'
            )
    out.append(
        f'<text x="{left + plot_w / 2:.0f}" y="{height - 4}" font-size="11" text-anchor="middle">step</text>'
    )
    out.append("</svg>")
    return "".join(out)


def write_html(summary: Any, path: str) -> str:
    """Write `summary` (a `BreakdownSummary`) as an HTML page at `path`; returns `path`."""
    rows = [row for rank in summary.per_rank for row in rank]
    if not rows:
        raise MisuseError(
            "The breakdown recorded no step: run at least one optimizer step before drawing it."
        )
    top = max(_finite(row["step"]) for row in rows) or 1.0
    mean = summary.mean()
    legend = "".join(
        f'<span style="margin-right:14px"><span style="display:inline-block;width:12px;height:12px;'
        f'background:{_COLOURS[p]}"></span> {p}</span>'
        for p in summary.parts
    )
    table = "".join(
        f"<tr><td>{p}</td><td>{mean[p] * 1e3:.3f}</td>"
        f"<td>{(mean[p] / mean['step'] if mean['step'] else 0):.1%}</td></tr>"
        for p in summary.parts
    )
    charts = "".join(
        f"<h3>rank {rank}</h3>{_svg(steps, summary.parts, top)}"
        for rank, steps in enumerate(summary.per_rank)
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>torchloom time breakdown</title>
<style>body{{font-family:sans-serif;margin:24px}}td,th{{padding:2px 10px;text-align:right}}
td:first-child{{text-align:left}}</style></head><body>
<h2>Time per step, per part ({summary.device})</h2><p>{legend}</p>
<table><tr><th>part</th><th>ms per step</th><th>share</th></tr>{table}
<tr><td><b>step</b></td><td><b>{mean["step"] * 1e3:.3f}</b></td><td></td></tr></table>
<p>Means over every rank's steps after the first. Hover a bar for its value.</p>{charts}</body></html>
"""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        file.write(page)
    return path


def write_png(summary: Any, path: str) -> str:
    """Write `summary` as a PNG at `path` with matplotlib (the `plot` extra); returns `path`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise MisuseError(
            "Drawing the breakdown as a PNG needs matplotlib: pip install 'torchloom[plot]' (or use "
            "write_html, which needs nothing)."
        ) from error
    ranks = summary.per_rank
    figure, axes = plt.subplots(len(ranks), 1, figsize=(9, 2.4 * len(ranks)), squeeze=False)
    for rank, (axis, steps) in enumerate(zip(axes[:, 0], ranks, strict=True)):
        bottom = [0.0] * len(steps)
        for part in summary.parts:
            values = [_finite(row[part]) * 1e3 for row in steps]
            axis.bar(range(len(steps)), values, bottom=bottom, color=_COLOURS[part], label=part, width=0.9)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        axis.set_ylabel("ms")
        axis.set_title(f"rank {rank}", fontsize=10)
    axes[0, 0].legend(ncol=len(summary.parts), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 1.45))
    axes[-1, 0].set_xlabel("step")
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
