"""Self-contained HTML reports with inline SVG charts, for the KFP UI's HTML viewer.

The KFP UI shows an `HTML` artifact in a sandboxed frame with no network, so charts are drawn as
inline SVG: no scripts, no external assets.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

_W, _H, _PAD = 640, 260, 44
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def bar_chart(title: str, labels: Sequence[str], values: Sequence[float]) -> str:
    """An SVG bar chart."""
    top = max([*values, 1e-12])
    n = max(len(values), 1)
    bw = (_W - 2 * _PAD) / n
    bars = []
    for i, (label, v) in enumerate(zip(labels, values, strict=True)):
        h = (_H - 2 * _PAD) * v / top
        x = _PAD + i * bw
        y = _H - _PAD - h
        bars.append(
            f'<rect x="{x + 1:.1f}" y="{y:.1f}" width="{max(bw - 2, 1):.1f}" height="{h:.1f}" '
            f'fill="{_COLOURS[0]}"><title>{html.escape(str(label))}: {_fmt(v)}</title></rect>'
        )
        if n <= 24:
            bars.append(
                f'<text x="{x + bw / 2:.1f}" y="{_H - _PAD + 14}" font-size="10" '
                f'text-anchor="middle">{html.escape(str(label))}</text>'
            )
    return _frame(title, "".join(bars), 0, top)


def line_chart(title: str, series: dict[str, Sequence[tuple[float, float]]]) -> str:
    """An SVG line chart of named series of (x, y) points."""
    points = [p for s in series.values() for p in s]
    if not points:
        return _frame(title, "", 0, 1)
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)

    def sx(x):
        return _PAD + (_W - 2 * _PAD) * (x - x0) / (x1 - x0)

    def sy(y):
        return _H - _PAD - (_H - 2 * _PAD) * (y - y0) / (y1 - y0)

    body = []
    for i, (name, pts) in enumerate(series.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        body.append(
            f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{path}">'
            f"<title>{html.escape(name)}</title></polyline>"
        )
        if len(pts) == 1:
            body.append(
                f'<circle cx="{sx(pts[0][0]):.1f}" cy="{sy(pts[0][1]):.1f}" r="3" fill="{colour}"/>'
            )
        body.append(
            f'<text x="{_W - _PAD + 4}" y="{_PAD + 12 * i}" font-size="10" fill="{colour}">'
            f"{html.escape(name)}</text>"
        )
    body.append(
        f'<text x="{_PAD}" y="{_H - _PAD + 14}" font-size="10">{_fmt(x0)}</text>'
        f'<text x="{_W - _PAD}" y="{_H - _PAD + 14}" font-size="10" text-anchor="end">'
        f"{_fmt(x1)}</text>"
    )
    return _frame(title, "".join(body), y0, y1)


def _frame(title: str, body: str, y0: float, y1: float) -> str:
    return (
        f'<figure><svg xmlns="http://www.w3.org/2000/svg" width="{_W + 60}" height="{_H}" '
        f'role="img" aria-label="{html.escape(title)}">'
        f'<text x="{_PAD}" y="18" font-size="13" font-weight="bold">{html.escape(title)}</text>'
        f'<line x1="{_PAD}" y1="{_H - _PAD}" x2="{_W - _PAD}" y2="{_H - _PAD}" stroke="#888"/>'
        f'<line x1="{_PAD}" y1="{_PAD}" x2="{_PAD}" y2="{_H - _PAD}" stroke="#888"/>'
        f'<text x="{_PAD - 4}" y="{_H - _PAD}" font-size="10" text-anchor="end">{_fmt(y0)}</text>'
        f'<text x="{_PAD - 4}" y="{_PAD + 4}" font-size="10" text-anchor="end">{_fmt(y1)}</text>'
        f"{body}</svg></figure>"
    )


def table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """An HTML table of dict rows."""
    if not rows:
        return "<p>(none)</p>"
    columns = list(columns or rows[0].keys())
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)

    def cell(v) -> str:
        return html.escape(_fmt(v) if isinstance(v, float) else str("" if v is None else v))

    body = "".join(
        "<tr>" + "".join(f"<td>{cell(r.get(c))}</td>" for c in columns) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def page(title: str, sections: Sequence[str]) -> str:
    """A whole HTML page."""
    style = (
        "body{font-family:sans-serif;margin:16px}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}figure{margin:8px 0}"
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>"
        + "".join(sections)
        + "</body></html>"
    )
