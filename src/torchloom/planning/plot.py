"""`torchloom plan --plot FILE.html`: each simulated rank's memory over the planned steps, stacked by kind, the
peak marked and the budget drawn across: one self-contained HTML page with inline SVG (no plotting library)."""

from __future__ import annotations

import html
from typing import Any

from torchloom.planning.plan import rank_label
from torchloom.planning.tracker import KINDS

_COLOURS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#9c755f")
_W, _H, _PAD = 900, 300, 50


def _rank_svg(entry: dict[str, Any], budget: int | None) -> str:
    samples = entry.get("timeline") or []
    top = max([entry["peak_bytes"], budget or 0, *(s[0] for s in samples)]) or 1
    n = max(len(samples) - 1, 1)

    def x(i: float) -> float:
        return _PAD + (_W - 2 * _PAD) * i / n

    def y(value: float) -> float:
        return _H - _PAD + 0.0 - (_H - 2 * _PAD) * value / top

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" font-family="sans-serif" font-size="11">'
    ]
    below = [0.0] * len(samples)
    for kind, colour in zip(KINDS, _COLOURS, strict=True):
        values = [s[3].get(kind, 0) for s in samples]
        if not any(values):
            continue
        upper = [b + v for b, v in zip(below, values, strict=True)]
        points = [f"{x(i):.1f},{y(u):.1f}" for i, u in enumerate(upper)]
        points += [f"{x(i):.1f},{y(b):.1f}" for i, b in reversed(list(enumerate(below)))]
        parts.append(f'<polygon points="{" ".join(points)}" fill="{colour}"><title>{kind}</title></polygon>')
        below = upper
    peak_i = max(range(len(samples)), key=lambda i: samples[i][0]) if samples else 0
    gib = entry["peak_bytes"] / 2**20
    parts.append(
        f'<circle cx="{x(peak_i):.1f}" cy="{y(entry["peak_bytes"]):.1f}" r="4" fill="black"/>'
        f'<text x="{x(peak_i) + 6:.1f}" y="{y(entry["peak_bytes"]) - 6:.1f}">peak {gib:.1f} MiB '
        f"({html.escape(entry['phase'])} {html.escape(entry['module'])})</text>"
    )
    if budget:
        parts.append(
            f'<line x1="{_PAD}" x2="{_W - _PAD}" y1="{y(budget):.1f}" y2="{y(budget):.1f}" stroke="red" '
            f'stroke-dasharray="6 4"/><text x="{_W - _PAD - 120}" y="{y(budget) - 4:.1f}" fill="red">budget '
            f"{budget / 2**20:.1f} MiB</text>"
        )
    parts.append(
        f'<line x1="{_PAD}" x2="{_PAD}" y1="{_PAD}" y2="{_H - _PAD}" stroke="black"/>'
        f'<line x1="{_PAD}" x2="{_W - _PAD}" y1="{_H - _PAD}" y2="{_H - _PAD}" stroke="black"/>'
        f'<text x="{_PAD}" y="{_H - _PAD + 16}">start</text>'
        f'<text x="{_W - _PAD - 60}" y="{_H - _PAD + 16}">end of step {entry["steps"]}</text>'
        f'<text x="4" y="{_PAD - 8}">{top / 2**20:.1f} MiB</text>'
    )
    parts.append("</svg>")
    return "".join(parts)


def plot_html(result: dict[str, Any]) -> str:
    """The plan as a page: one chart per simulated rank and a legend of the kinds."""
    legend = " ".join(
        f'<span style="background:{c};padding:2px 6px;color:white">{k}</span>'
        for k, c in zip(KINDS, _COLOURS, strict=True)
    )
    charts = []
    for entry in result["ranks"]:
        who = rank_label(entry)
        charts.append(f"<h2>{html.escape(who)}</h2>{_rank_svg(entry, result.get('budget_bytes'))}")
    title = html.escape(f"torchloom plan: {result['script']} on {result['world_size']} ranks")
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title></head><body "
        f"style='font-family:sans-serif'><h1>{title}</h1><p>Memory at each local high of the first "
        f"{result['steps']} training steps, stacked by kind.</p><p>{legend}</p>{''.join(charts)}</body></html>"
    )
