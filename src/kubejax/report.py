"""Self-contained HTML reports for the KFP UI's HTML viewer, with matplotlib figures.

The KFP UI shows an `HTML` artifact in a sandboxed frame with no network: each figure is
embedded as inline SVG text (no scripts, no external assets). The same Figure objects are
logged to MLflow (`Tracker.log_figure`) on the run they describe.
"""

from __future__ import annotations

import html
import io
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with this module
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

_METADATA = re.compile(r"<metadata>.*?</metadata>\s*", re.S)
#: Figure size in inches (at 100 dpi: 7.2 × 3.6 in ≈ 720 × 360 px in the report).
SIZE = (7.2, 3.6)


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display: files and strings only)."""
    import matplotlib

    matplotlib.use("Agg")
    # Text stays text in the SVG (searchable, small), drawn in the viewer's sans-serif font.
    matplotlib.rcParams["svg.fonttype"] = "none"
    import matplotlib.pyplot as plt

    return plt


def new_figure(title: str, xlabel: str, ylabel: str, size=SIZE) -> tuple[Figure, Axes]:
    """A figure with one titled axes, labelled, with a light grid."""
    fig, ax = pyplot().subplots(figsize=size, layout="constrained")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def svg(fig: Figure) -> str:
    """The figure as inline SVG inside a <figure> element (the figure stays open, for MLflow)."""
    buf = io.StringIO()
    # bbox "tight": labels drawn outside the axes (rotated parameter names) are kept.
    fig.savefig(buf, format="svg", metadata={"Date": None}, bbox_inches="tight")
    text = buf.getvalue()
    text = text[text.index("<svg") :]  # drop the XML prolog and doctype
    text = _METADATA.sub("", text)  # RDF metadata: namespace URLs, nothing a viewer needs
    return f"<figure>{text}</figure>"


def close(figures: Iterable[Figure]) -> None:
    """Release figures once they are written (matplotlib keeps them otherwise)."""
    for fig in figures:
        pyplot().close(fig)


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
        "svg{max-width:100%;height:auto}"
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>"
        + "".join(sections)
        + "</body></html>"
    )
