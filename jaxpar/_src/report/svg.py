"""Plain SVG pictures for reports: device grids, stacked bars, a step timeline.

No plotting library and no script: each function returns an ``<svg>`` string that any browser
(and a notebook output) draws as is.  Numbers shown in tooltips (``<title>``) are formatted by
the caller.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence

from jaxpar._src.spec import MeshShape, Spec

# Tableau 10 plus two: distinct on white, readable with dark text.
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac", "#86bcb6", "#d4a6c8")
REPLICATED = "#d9d9d9"
COMPUTE = "#8cb2d8"


def color(i: int) -> str:
    """The ``i``-th colour of the palette (cycling)."""
    return PALETTE[i % len(PALETTE)]


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def device_grid(spec: Spec, mesh: MeshShape, device_ids: Sequence[int] = (), *,
                cell: int = 22) -> str:
    """Which block of a tensor each device holds, as a grid of the mesh.

    Rows are the first mesh axis, columns the others (row-major).  Devices that hold the same
    block share a colour; a cell's label is its block's index along each split dimension
    (``0,1``), or ``=`` when the tensor is whole on every device.

    >>> svg = device_grid(Spec((("dp",), ("mp",))), MeshShape(("dp", "mp"), (2, 2)))
    >>> svg.count("<rect"), "1,0" in svg
    (4, True)
    """
    sizes = mesh.sizes
    rows = sizes[0] if len(sizes) > 1 else 1
    cols = math.prod(sizes) // rows
    n = rows * cols
    labels = n <= 64
    cell = cell if n <= 256 else max(6, cell // 2)
    w, h = cols * cell + 2, rows * cell + 2
    # per dimension: the (axis position, stride) pairs that make its block index
    dims = []
    for axes in spec.dims:
        stride, parts = 1, []
        for a in reversed(axes):
            parts.append((mesh.names.index(a), stride))
            stride *= mesh.size(a)
        dims.append(parts)
    split = [i for i, d in enumerate(spec.dims) if d]
    counts = [mesh.product(spec.dims[i]) for i in split]
    out = [f'<svg class="grid" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           f'role="img" aria-label="{esc(spec)} on {esc(mesh)}">']
    for flat in range(n):
        idx = _unravel(flat, sizes)
        block = [sum(idx[p] * s for p, s in dims[i]) for i in split]
        linear = 0
        for b, c in zip(block, counts, strict=True):
            linear = linear * c + b
        fill = color(linear) if split else REPLICATED
        r, c = divmod(flat, cols)
        dev = device_ids[flat] if flat < len(device_ids) else flat
        text = ",".join(map(str, block)) if split else "="
        tip = (f"device {dev} at {dict(zip(mesh.names, idx, strict=True))}: block "
               f"({text})" if split else f"device {dev}: the whole tensor")
        x, y = 1 + c * cell, 1 + r * cell
        out.append(f'<g><title>{esc(tip)}</title><rect x="{x}" y="{y}" width="{cell - 1}" '
                   f'height="{cell - 1}" fill="{fill}" rx="2"/>')
        if labels:
            size = 10 if len(text) <= 3 else 8
            out.append(f'<text x="{x + (cell - 1) / 2:g}" y="{y + cell / 2 + 3:g}" '
                       f'font-size="{size}" text-anchor="middle">{esc(text)}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def _unravel(flat: int, sizes: Sequence[int]) -> list[int]:
    idx = []
    for s in reversed(sizes):
        flat, r = divmod(flat, s)
        idx.append(r)
    return idx[::-1]


def stacked_bars(rows: Sequence[tuple[str, Sequence[tuple[str, float, str]]]],
                 fmt: Callable[[float], str], *, width: int = 560, bar: int = 18,
                 marker: tuple[str, float] | None = None) -> str:
    """Horizontal stacked bars: ``rows`` = ``[(label, [(part, value, colour), ...]), ...]``.

    ``fmt`` formats a value for labels; ``marker`` = ``(label, value)`` draws a vertical line
    (a budget) when it falls within twice the longest bar.

    >>> svg = stacked_bars([("a", [("x", 1.0, "#000")])], str)
    >>> svg.startswith("<svg") and "<title>a: x 1.0</title>" in svg
    True
    """
    label_w, pad = 170, 90
    top = max((sum(v for _, v, _ in parts) for _, parts in rows), default=0.0)
    scale_max = top
    shown = marker if marker is not None and 0 < marker[1] <= 2 * max(top, 1e-30) else None
    if shown is not None:
        scale_max = max(top, shown[1])
    scale_max = scale_max or 1.0
    span = width - label_w - pad
    h = len(rows) * (bar + 8) + 8
    out = [f'<svg class="bars" width="{width}" height="{h}" viewBox="0 0 {width} {h}" '
           f'role="img">']
    for i, (label, parts) in enumerate(rows):
        y = 4 + i * (bar + 8)
        out.append(f'<text x="{label_w - 6}" y="{y + bar - 5}" font-size="12" '
                   f'text-anchor="end">{esc(label)}</text>')
        x = float(label_w)
        for part, value, fill in parts:
            w = span * value / scale_max
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{max(w, 0.5):.1f}" height="{bar}" '
                       f'fill="{fill}"><title>{esc(label)}: {esc(part)} {esc(fmt(value))}'
                       f'</title></rect>')
            x += w
        total = sum(v for _, v, _ in parts)
        out.append(f'<text x="{x + 4:.1f}" y="{y + bar - 5}" font-size="11">'
                   f'{esc(fmt(total))}</text>')
    if shown is not None:
        mx = label_w + span * shown[1] / scale_max
        out.append(f'<line x1="{mx:.1f}" x2="{mx:.1f}" y1="0" y2="{h}" stroke="#c00" '
                   f'stroke-dasharray="4 3"><title>{esc(shown[0])}</title></line>')
    out.append("</svg>")
    return "".join(out)


def legend(items: Sequence[tuple[str, str]]) -> str:
    """Colour swatches with labels, as HTML."""
    return "".join(f'<span class="sw"><i style="background:{c}"></i>{esc(t)}</span>'
                   for t, c in items)


def timeline(lanes: Sequence[str], segments: Sequence[tuple[int, float, float, str, str]],
             total: float, fmt: Callable[[float], str], *, width: int = 900) -> str:
    """Segments on lanes against time: ``segments`` = ``[(lane, start, length, colour, tip)]``.

    Adjacent segments narrower than a pixel on the same lane are drawn as one, so the picture
    stays small for programs with thousands of operators.

    >>> svg = timeline(["compute"], [(0, 0.0, 1.0, "#000", "op")], 1.0, str)
    >>> svg.count("<rect")
    1
    """
    label_w, lane_h, axis_h = 110, 22, 22
    span = width - label_w - 10
    total = total or 1.0
    h = len(lanes) * lane_h + axis_h
    out = [f'<svg class="timeline" width="{width}" height="{h}" viewBox="0 0 {width} {h}" '
           f'role="img">']
    for i, lane in enumerate(lanes):
        y = i * lane_h
        out.append(f'<text x="{label_w - 6}" y="{y + 15}" font-size="12" '
                   f'text-anchor="end">{esc(lane)}</text>')
        out.append(f'<line x1="{label_w}" x2="{width - 10}" y1="{y + lane_h - 2}" '
                   f'y2="{y + lane_h - 2}" stroke="#eee"/>')
    merged = _merge(segments, span / total)
    for row, x0, x1, fill, tip, count in merged:
        y = row * lane_h + 2
        tip = tip if count == 1 else f"{count} items, e.g. {tip}"
        out.append(f'<rect x="{label_w + x0:.1f}" y="{y}" width="{max(x1 - x0, 1.0):.1f}" '
                   f'height="{lane_h - 6}" fill="{fill}"><title>{esc(tip)}</title></rect>')
    y = len(lanes) * lane_h + 14
    for k in range(5):
        x = label_w + span * k / 4
        anchor = "end" if k == 4 else "middle"
        out.append(f'<text x="{x:.1f}" y="{y}" font-size="10" text-anchor="{anchor}">'
                   f'{esc(fmt(total * k / 4))}</text>')
    out.append("</svg>")
    return "".join(out)


def _merge(segments: Sequence[tuple[int, float, float, str, str]], px: float
           ) -> list[tuple[int, float, float, str, str, int]]:
    """Segments in pixels, joining same-lane, same-colour neighbours less than a pixel apart
    (each keeps its first tooltip and how many it joined)."""
    out: list[tuple[int, float, float, str, str, int]] = []
    last: dict[int, int] = {}
    for lane, start, length, fill, tip in segments:
        x0, x1 = start * px, (start + length) * px
        k = last.get(lane)
        if k is not None:
            ln, a, b, f, first, count = out[k]
            if f == fill and x0 - b < 1.0:
                out[k] = (ln, a, max(b, x1), f, first, count + 1)
                continue
        last[lane] = len(out)
        out.append((lane, x0, x1, fill, tip, 1))
    return out
