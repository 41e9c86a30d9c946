"""``Report.save``: a :class:`~pallas_core.report.Report` as one self-contained HTML page.

The page holds hand-written inline SVG and a little CSS, nothing fetched from the network and
no script, so it opens from a file anywhere (a CI artifact, an attachment). It shows:

- **the roofline chart**: log-log axes, arithmetic intensity (FLOPs per HBM byte) against
  attainable FLOP/s; each chip's roof (its HBM bandwidth's slope, then the matrix units' peak
  for the kernel's matmul operand type) with its ridge marked, and each kernel's point on
  each chip (its FLOPs over the roofline's lower bound on its time);
- **a block map per operand**: grid steps along x (in the order the grid runs, the last axis
  fastest), the blocks the operand touches along y (each distinct block index, in order); a
  dark cell is a step where the pipeline moves the block (fetches an input, writes an output
  back), a light cell a step that keeps the previous step's block. Grids of rank 3 or more
  are drawn as small multiples, one panel per index of the outer axes. Index maps driven by
  scalar-prefetch values are marked (hatched where the values were drawn at random). Large
  grids are binned (and the page says so): see :data:`MAX_STEPS`, :data:`MAX_ROWS`,
  :data:`MAX_PANELS`;
- **the on-chip footprint**: the backend's parts as a stacked bar against the chip's limit,
  red when the kernel does not fit;
- the text table (``str(report)``).

Elements carry stable classes for tests and styling: ``svg.roofline`` (with
``circle.roofline-point[data-kernel][data-chip]`` and ``g.roof[data-chip]``),
``svg.block-map[data-kernel][data-operand]`` (with ``rect.cell.moved`` and
``rect.cell.kept``) and ``svg.footprint[data-kernel][data-fits]``.
"""

from __future__ import annotations

import html
import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from pallas_core.errors import ArgumentError
from pallas_core.units import nbytes, seconds, si

if TYPE_CHECKING:
    from pallas_core.report import KernelReport, OperandReport, Report

MAX_STEPS = 256
"""Columns a block-map panel draws; more grid steps are binned, several per column."""
MAX_ROWS = 96
"""Rows a block-map panel draws; more distinct blocks are binned, several per row."""
MAX_PANELS = 16
"""Panels (indices of the outer grid axes) a block map draws; the rest are left out."""

# Colours used nowhere else on the page, so that a screenshot can be checked by its pixels.
ROOF_BACKGROUND = "#eef2fb"
MAP_BACKGROUND = "#f7f3e8"
MOVED = {"input": "#1565c0", "output": "#d84315"}
KEPT = {"input": "#b3cdea", "output": "#f3c3ac"}
OVER_LIMIT = "#c62828"
_CHIP_COLOURS = ("#6a1b9a", "#00897b", "#ef6c00", "#283593", "#7cb342", "#ad1457", "#5d4037",
                 "#0097a7")
_PART_COLOURS = ("#5c6bc0", "#26a69a", "#ffa726", "#8d6e63", "#ab47bc", "#78909c", "#d4e157",
                 "#ec407a")

_CSS = """
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222;
       margin: 24px; max-width: 1320px; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 18px; margin: 28px 0 6px; }
h3 { font-size: 14px; margin: 18px 0 4px; }
.muted { color: #666; } .warn { color: #c62828; font-weight: 600; }
.badge { display: inline-block; padding: 0 6px; border-radius: 8px; font-size: 12px;
         background: #fff3cd; border: 1px solid #e0b84c; margin-left: 6px; }
svg { display: block; margin: 4px 0 6px; }
svg text { font: 11px system-ui, sans-serif; fill: #333; }
svg .title { font-size: 12px; font-weight: 600; }
p.legend { margin: 0 0 14px; font-size: 12px; }
rect.cell { shape-rendering: crispEdges; }
pre { background: #f6f6f6; padding: 10px; overflow-x: auto; font-size: 12px; }
ul.notes { margin: 4px 0; padding-left: 20px; color: #555; }
"""


def save(report: Report, path: str | os.PathLike[str], *, title: str | None = None
         ) -> pathlib.Path:
    """Writes :func:`page` of ``report`` to ``path`` (UTF-8) and returns the path."""
    out = pathlib.Path(path)
    if out.is_dir():
        raise ArgumentError(f"Report.save({str(path)!r}): expected a file name, found a "
                            "directory. Fix: name the HTML file, e.g. 'kernel.html'.")
    out.write_text(page(report, title=title), encoding="utf-8")
    return out


def page(report: Report, *, title: str | None = None) -> str:
    """The HTML page of ``report``: roofline chart, block maps, footprint bars, table."""
    kernels = list(report.kernels)
    title = title or (f"pl.report: {kernels[0].name}" if len(kernels) == 1
                      else f"pl.report: {len(kernels)} kernels")
    body = [f"<h1>{_e(title)}</h1>",
            f'<p class="muted">{len(kernels)} kernel{"s" * (len(kernels) != 1)}; drawn from '
            "the grid mapping, before anything runs.</p>"]
    if kernels:
        body += ["<h2>Roofline</h2>", _roofline_svg(kernels)]
    for i, k in enumerate(kernels):
        body.append(_kernel_section(i, k, len(kernels)))
    body += ["<h2>Table</h2>", f"<pre>{_e(str(report))}</pre>"]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


# --- the roofline chart ------------------------------------------------------------------


def _roofline_svg(kernels: Sequence[KernelReport]) -> str:
    from pallas_core.report import chips

    known = chips()
    roofs: dict[tuple[str, float], float] = {}  # (target, peak) -> bandwidth
    points = []  # (kernel index, target, intensity, attainable)
    for i, k in enumerate(kernels):
        for target, r in k.roofline.items():
            bandwidth = known[target][1].hbm_bandwidth if target in known else None
            if bandwidth is None:
                continue
            roofs[(target, r.ridge * bandwidth)] = bandwidth
            if k.flops and r.seconds > 0:
                points.append((i, target, r.intensity, k.flops / r.seconds))
    if not roofs:
        return ('<p class="muted roofline-none">No chip to draw a roofline for: the backend '
                "lists none (pass <code>target=</code> to pl.report).</p>")
    ridges = [peak / bw for (_, peak), bw in roofs.items()]
    finite = [p[2] for p in points if math.isfinite(p[2]) and p[2] > 0]
    x_lo = 10.0 ** math.floor(math.log10(min([*ridges, *finite]) / 8))
    x_hi = 10.0 ** math.ceil(math.log10(max([*ridges, *finite]) * 8))
    y_hi = 10.0 ** math.ceil(math.log10(max(peak for _, peak in roofs) * 1.5))
    y_lo = 10.0 ** math.floor(math.log10(min(
        [bw * x_lo for bw in roofs.values()] + [p[3] for p in points])))
    left, top, width, height, legend = 70, 16, 640, 360, 400
    W, H = left + width + 20 + legend, top + height + 48

    def x(v: float) -> float:
        v = min(max(v, x_lo), x_hi)
        return left + width * math.log10(v / x_lo) / math.log10(x_hi / x_lo)

    def y(v: float) -> float:
        v = min(max(v, y_lo), y_hi)
        return top + height - height * math.log10(v / y_lo) / math.log10(y_hi / y_lo)

    out = [f'<svg class="roofline" xmlns="http://www.w3.org/2000/svg" width="{W}" '
           f'height="{H}" viewBox="0 0 {W} {H}" role="img" aria-label="roofline chart">',
           f'<rect class="plot-area" x="{left}" y="{top}" width="{width}" height="{height}" '
           f'fill="{ROOF_BACKGROUND}" shape-rendering="crispEdges"/>']
    for v in _decades(x_lo, x_hi):  # vertical grid lines, labelled below the plot
        gx = f"{x(v):.1f}"
        out += [_grid_line(gx, top, gx, top + height),
                _svg_text(gx, top + height + 16, "middle", _e(si(v, "")))]
    for v in _decades(y_lo, y_hi):  # horizontal ones, labelled on its left
        gy = y(v)
        out += [_grid_line(left, f"{gy:.1f}", left + width, f"{gy:.1f}"),
                _svg_text(left - 6, f"{gy + 4:.1f}", "end", _e(si(v, "")))]
    out.append(f'<text x="{left + width / 2}" y="{H - 8}" text-anchor="middle">arithmetic '
               "intensity (FLOP per HBM byte)</text>")
    out.append(f'<text transform="translate(16 {top + height / 2}) rotate(-90)" '
               'text-anchor="middle">attainable FLOP/s</text>')
    colour = {t: _CHIP_COLOURS[n % len(_CHIP_COLOURS)]
              for n, t in enumerate(dict.fromkeys(t for t, _ in roofs))}
    seen: set[str] = set()
    for n, ((target, peak), bw) in enumerate(roofs.items()):
        ridge = peak / bw
        c = colour[target]
        dash = ' stroke-dasharray="9 4"' if target in seen else ""  # another dtype's peak
        seen.add(target)
        dtype = _peak_dtype(known[target][1].matmul_flops, peak)
        path = (f"M{x(x_lo):.1f},{y(bw * x_lo):.1f} L{x(ridge):.1f},{y(peak):.1f} "
                f"L{x(x_hi):.1f},{y(peak):.1f}")
        out.append(f'<g class="roof" data-chip="{_e(target)}"><title>{_e(target)}: '
                   f'{_e(si(peak, "FLOP/s"))} {dtype} peak, {_e(si(bw, "B/s"))}, ridge '
                   f'{ridge:.1f} FLOP/B</title>'
                   f'<path d="{path}" fill="none" stroke="{c}" stroke-width="2.5"{dash}/>'
                   f'<line class="ridge" x1="{x(ridge):.1f}" y1="{y(peak):.1f}" '
                   f'x2="{x(ridge):.1f}" y2="{top + height}" stroke="{c}" '
                   'stroke-dasharray="4 3"/>'
                   f'<text x="{x(ridge) + 3:.1f}" y="{top + height - 6 - 13 * n}" '
                   f'fill="{c}" style="fill:{c}">ridge {ridge:.0f}</text></g>')
        ly = top + 10 + 18 * n
        out.append(f'<line x1="{left + width + 20}" y1="{ly - 7}" x2="{left + width + 36}" '
                   f'y2="{ly - 7}" stroke="{c}" stroke-width="3"{dash}/>'
                   f'<text x="{left + width + 40}" y="{ly - 3}">{_e(target)} ({dtype}): '
                   f'{_e(si(peak, "FLOP/s"))}, {_e(si(bw, "B/s"))}, ridge '
                   f"{ridge:.0f} FLOP/B</text>")
    ly = top + 10 + 18 * len(roofs) + 8
    for i, target, intensity, attainable in points:
        k = kernels[i]
        r = k.roofline[target]
        label = _kernel_label(i, k, len(kernels))
        px, py = x(intensity), y(attainable)
        shown = "∞" if not math.isfinite(intensity) else f"{intensity:.1f}"
        out.append(
            f'<circle class="roofline-point" data-kernel="{i}" data-chip="{_e(target)}" '
            f'cx="{px:.1f}" cy="{py:.1f}" r="5.5" fill="{colour[target]}" stroke="#fff" '
            f'stroke-width="1.5"><title>{_e(label)} on {_e(target)}: {shown} FLOP/B, '
            f'{_e(si(attainable, "FLOP/s"))}, {r.bound}-bound, &gt;= '
            f'{_e(seconds(r.seconds))}</title></circle>'
            f'<text x="{px - 8:.1f}" y="{py - 5:.1f}" text-anchor="end">{_e(label)} on '
            f'{_e(target)}</text>')
        out.append(f'<text x="{left + width + 20}" y="{ly}">{_e(label)} on {_e(target)}: '
                   f'{r.bound}-bound, &gt;= {_e(seconds(r.seconds))}</text>')
        ly += 16
    out.append("</svg>")
    skipped = [f"{_kernel_label(i, k, len(kernels))} does no FLOPs"
               for i, k in enumerate(kernels) if k.roofline and not k.flops]
    if skipped:
        out.append(f'<p class="muted">Not on the chart: {_e("; ".join(skipped))}.</p>')
    return "\n".join(out)


def _decades(lo: float, hi: float) -> list[float]:
    """The powers of ten from ``lo`` to ``hi`` (both powers of ten): where grid lines go."""
    return [10.0 ** e for e in range(round(math.log10(lo)), round(math.log10(hi)) + 1)]


def _grid_line(x1: object, y1: object, x2: object, y2: object) -> str:
    return f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="#d5dbe8"/>'


def _svg_text(x: object, y: object, anchor: str, text: str) -> str:
    return f'<text x="{x}" y="{y}" text-anchor="{anchor}">{text}</text>'


def _peak_dtype(peaks: Mapping[str, float], peak: float) -> str:
    """The operand type whose matrix peak is ``peak`` (bfloat16 first among equals)."""
    names = [d for d, v in peaks.items() if math.isclose(v, peak, rel_tol=1e-9)]
    return "bfloat16" if "bfloat16" in names or not names else names[0]


# --- one kernel --------------------------------------------------------------------------


def _kernel_section(i: int, k: KernelReport, count: int) -> str:
    head = (f"<h2>{_e(_kernel_label(i, k, count))} on {_e(k.backend)}: grid "
            f"{_e(str(tuple(k.grid)))} ({k.steps:,} steps)</h2>")
    bounds = ", ".join(f"{_e(t)}: {r.bound}-bound, &gt;= {_e(seconds(r.seconds))}"
                       for t, r in k.roofline.items())
    parts = [head, f'<p>{_e(si(k.flops, "FLOP"))} ({_e(si(k.matmul_flops, "FLOP"))} '
             f'matmul), {k.transcendentals:,} transcendentals, HBM traffic '
             f'{_e(nbytes(k.hbm_bytes))}{"; " + bounds if bounds else ""}.</p>',
             "<h3>On chip</h3>", _footprint_svg(i, k), "<h3>Block maps</h3>"]
    parts += [_block_map(i, k, o) for o in k.operands]
    if k.notes:
        parts.append('<ul class="notes">' + "".join(f"<li>{_e(n)}</li>" for n in k.notes)
                     + "</ul>")
    return f'<section class="kernel" data-kernel="{i}">\n' + "\n".join(parts) + "\n</section>"


def _kernel_label(i: int, k: KernelReport, count: int) -> str:
    return f"#{i} {k.name}" if count > 1 else k.name


def _footprint_svg(i: int, k: KernelReport) -> str:
    if k.onchip_bytes is None or k.onchip_limit is None:
        return (f'<p class="muted footprint-none">The {_e(k.backend)} backend keeps no '
                "on-chip account for this kernel.</p>")
    total, limit = k.onchip_bytes, k.onchip_limit
    scale = max(total, limit, 1) * 1.04
    left, width, bar_y, bar_h = 10, 900, 20, 26
    rows = (len(k.onchip_parts) + 1) // 2
    H = bar_y + bar_h + 24 + 18 * rows

    def x(b: float) -> float:
        return left + width * b / scale

    verdict = "fits" if k.fits else "does NOT fit"
    out = [f'<p class="{"" if k.fits else "warn"}">{_e(nbytes(total))} of the '
           f"{_e(nbytes(limit))} limit ({100 * total / max(limit, 1):.3g}%): {verdict}</p>",
           f'<svg class="footprint" data-kernel="{i}" data-fits="{str(bool(k.fits)).lower()}" '
           f'xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{H}" '
           f'viewBox="0 0 {left + width + 20} {H}" role="img" aria-label="on-chip footprint">',
           f'<rect x="{left}" y="{bar_y}" width="{width}" height="{bar_h}" fill="#f0f0f0" '
           'shape-rendering="crispEdges"/>']
    start = 0
    for n, (name, size) in enumerate(k.onchip_parts):
        c = _PART_COLOURS[n % len(_PART_COLOURS)]
        out.append(f'<rect class="part" x="{x(start):.1f}" y="{bar_y}" '
                   f'width="{max(x(start + size) - x(start), 2):.1f}" height="{bar_h}" '
                   f'fill="{c}" stroke="#fff" shape-rendering="crispEdges"><title>{_e(name)}: '
                   f'{_e(nbytes(size))}</title></rect>')
        lx, ly = left + 460 * (n % 2), bar_y + bar_h + 18 + 18 * (n // 2)
        out.append(f'<rect x="{lx}" y="{ly - 10}" width="10" height="10" fill="{c}"/>'
                   f'<text x="{lx + 15}" y="{ly}">{_e(_clip(name, 60))}: '
                   f'{_e(nbytes(size))}</text>')
        start += size
    if not k.fits:
        out.append(f'<rect class="over-limit" x="{x(limit):.1f}" y="{bar_y - 3}" '
                   f'width="{x(total) - x(limit):.1f}" height="{bar_h + 6}" fill="none" '
                   f'stroke="{OVER_LIMIT}" stroke-width="3"/>')
    lim = OVER_LIMIT if not k.fits else "#222"
    out.append(f'<line class="limit" x1="{x(limit):.1f}" y1="{bar_y - 6}" x2="{x(limit):.1f}" '
               f'y2="{bar_y + bar_h + 6}" stroke="{lim}" stroke-width="2"/>'
               f'<text x="{x(limit) - 4:.1f}" y="14" text-anchor="end">limit '
               f'{_e(nbytes(limit))}</text>')
    out.append("</svg>")
    return "\n".join(out)


# --- block maps --------------------------------------------------------------------------


def _block_map(i: int, k: KernelReport, o: OperandReport) -> str:
    head = (f"<p><b>{_e(o.name)}</b> <span class=\"muted\">{_e(o.role)}, block "
            f"{_e(str(tuple(o.block_shape)))} {_e(o.dtype)} in {_e(o.memory_space)}: "
            f"{o.blocks:,} moved, {o.skipped:,} kept</span>")
    if o.index_source == "sampled":
        head += ('<span class="badge">indices from scalar-prefetch values drawn at random '
                 "(an estimate; pass the arrays to pl.report to count exactly)</span>")
    elif o.index_source == "given":
        head += '<span class="badge">indices from the scalar-prefetch values given</span>'
    head += "</p>"
    if o.block_indices is None or o.moved is None:
        why = {"scalar prefetch": "a scalar-prefetch operand, read whole into scalar memory",
               "whole": "the kernel copies this operand itself"}.get(
                   o.role, "its block indices are not known ahead of time")
        return head + f'<p class="muted block-map-none">No block map: {_e(why)}.</p>'
    return head + _map_svg(i, k, o, np.asarray(o.block_indices), np.asarray(o.moved, bool))


def _map_svg(i: int, k: KernelReport, o: OperandReport, table: np.ndarray, moved: np.ndarray
             ) -> str:
    steps = len(table)
    if not steps:
        return '<p class="muted block-map-none">No block map: the grid has no steps.</p>'
    grid = tuple(int(g) for g in k.grid)
    outer = grid[:-2] if len(grid) >= 3 and int(np.prod(grid)) == steps else ()
    inner = steps // max(int(np.prod(outer, dtype=np.int64)), 1) if outer else steps
    panels = -(-steps // max(inner, 1))
    if table.shape[1]:
        blocks, row = np.unique(table, axis=0, return_inverse=True)
        row = np.asarray(row).reshape(-1)
    else:
        blocks, row = np.zeros((1, 0), table.dtype), np.zeros(steps, np.int64)
    drawn = min(panels, MAX_PANELS)
    col_bin = -(-max(inner, 1) // MAX_STEPS)
    row_bin = -(-len(blocks) // MAX_ROWS)
    ncols, nrows = -(-max(inner, 1) // col_bin), -(-len(blocks) // row_bin)

    step = np.arange(min(steps, drawn * inner))
    key = np.stack([step // inner, (step % inner) // col_bin, row[step] // row_bin], axis=1)
    cells, where = np.unique(key, axis=0, return_inverse=True)
    any_moved = np.zeros(len(cells), bool)
    np.logical_or.at(any_moved, np.asarray(where).reshape(-1), moved[step])

    size = _cell_size(ncols, nrows, drawn)
    cw, ch = size, max(size, min(14, 48 // max(nrows, 1)))
    every = 1
    while every * ch < 14:  # a label every 14 px at least, on a power of two
        every *= 2
    labels = [(r, _tuple(blocks[r * row_bin])) for r in range(0, nrows, every)]
    if labels[-1][0] != nrows - 1:
        labels.append((nrows - 1, _tuple(blocks[(nrows - 1) * row_bin])))
    if len(labels) > 1 and labels[-1][0] - labels[-2][0] < every:
        del labels[-1]  # too close to the one before
    left = 14 + 7 * max(len(s) for _, s in labels)
    pw, ph = ncols * cw, nrows * ch
    gap, title_h = 16, (16 if outer else 0)
    per_line = max(1, min(drawn, (1240 - left) // (pw + gap)))
    lines = -(-drawn // per_line)
    per_line = -(-drawn // lines)  # as many panels on each line as can be
    W = left + per_line * (pw + gap)
    H = 4 + lines * (title_h + ph + 22)
    sampled = o.index_source == "sampled"
    role = "output" if o.role == "output" else "input"
    out = [f'<svg class="block-map" data-kernel="{i}" data-operand="{_e(o.name)}" '
           f'data-index-source="{_e(o.index_source)}" xmlns="http://www.w3.org/2000/svg" '
           f'width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img" '
           f'aria-label="block map of {_e(o.name)}">',
           f'<rect width="{W}" height="{H}" fill="{MAP_BACKGROUND}" '
           'shape-rendering="crispEdges"/>']
    if sampled:
        out.append(f'<defs><pattern id="hatch-{i}-{_slug(o.name)}" width="6" height="6" '
                   'patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
                   '<line x1="0" y1="0" x2="0" y2="6" stroke="#fff" stroke-width="2" '
                   'stroke-opacity="0.6"/></pattern></defs>')
    origin = []
    for p in range(drawn):
        ox = left + (p % per_line) * (pw + gap)
        oy = 4 + (p // per_line) * (title_h + ph + 22) + title_h
        origin.append((ox, oy))
        if outer:
            idx = np.unravel_index(p, outer)
            name = "(" + ", ".join([*(str(int(v)) for v in idx), ":", ":"]) + ")"
            out.append(f'<text class="title" x="{ox}" y="{oy - 4}">grid {_e(name)}</text>')
        out.append(f'<rect x="{ox - 0.5}" y="{oy - 0.5}" width="{pw + 1}" height="{ph + 1}" '
                   'fill="#fff" stroke="#999" shape-rendering="crispEdges"/>')
        last = min(inner, steps - p * inner) - 1
        out.append(f'<text x="{ox}" y="{oy + ph + 13}">0</text><text x="{ox + pw}" '
                   f'y="{oy + ph + 13}" text-anchor="end">{last}</text>')
        if p % per_line == 0:
            for r, label in labels:
                out.append(f'<text x="{ox - 4}" y="{oy + r * ch + ch / 2 + 4:.1f}" '
                           f'text-anchor="end">{_e(label)}</text>')
        if grid and grid[-1] > 1 and inner // grid[-1] <= 64 and cw * grid[-1] >= 6 * col_bin:
            for c in range(grid[-1], inner, grid[-1]):  # where the second-last axis moves on
                out.append(f'<line x1="{ox + c * cw / col_bin:.1f}" y1="{oy}" '
                           f'x2="{ox + c * cw / col_bin:.1f}" y2="{oy + ph}" '
                           'stroke="#e4e4e4" shape-rendering="crispEdges"/>')
    tips = len(cells) <= 2048 and col_bin == row_bin == 1
    for (p, c, r), m in zip(cells.tolist(), any_moved.tolist(), strict=True):
        ox, oy = origin[p]
        fill = MOVED[role] if m else KEPT[role]
        tip = ""
        if tips:
            s = p * inner + c
            at = _tuple(np.unravel_index(s, grid)) if int(np.prod(grid)) == steps else str(s)
            tip = (f"<title>step {at}: block {_e(_tuple(blocks[r]))}, "
                   f"{_verb(role, m)}</title>")
        out.append(f'<rect class="cell {"moved" if m else "kept"}" x="{ox + c * cw}" '
                   f'y="{oy + r * ch}" width="{cw}" height="{ch}" fill="{fill}">{tip}</rect>')
    if o.index_source in ("sampled", "given"):  # indices from scalar-prefetch values
        fill = f"url(#hatch-{i}-{_slug(o.name)})" if sampled else "none"
        dash = ' stroke-dasharray="4 2"' if sampled else ""
        for ox, oy in origin:
            out.append(f'<rect class="{o.index_source}" x="{ox - 1}" y="{oy - 1}" '
                       f'width="{pw + 2}" height="{ph + 2}" fill="{fill}" stroke="#e0b84c" '
                       f'stroke-width="2"{dash}/>')
    out.append("</svg>")
    axes = (f"steps over grid axes {', '.join(str(a) for a in range(len(outer), len(grid)))}"
            " in each panel" if outer else "grid steps")
    notes = [f"x: {axes} (last axis fastest); y: the {len(blocks):,} distinct blocks "
             "touched, by block index"]
    if col_bin > 1 or row_bin > 1:
        notes.append(f"binned: {col_bin} steps per column, {row_bin} blocks per row (a cell is "
                     "dark when any of its steps moves a block)")
    if drawn < panels:
        notes.append(f"the first {drawn} of {panels} panels are drawn")
    out.append(f'<p class="legend"><span style="color:{MOVED[role]}">&#9632;</span> '
               f'{_verb(role, True)} <span style="color:{KEPT[role]}">&#9632;</span> '
               f'{_verb(role, False)} <span class="muted">{_e("; ".join(notes))}.</span></p>')
    return "\n".join(out)


def _cell_size(ncols: int, nrows: int, panels: int) -> int:
    """The largest cell (2 to 16 px) that keeps a block map within about 1240 x 480 px."""
    for size in range(16, 2, -1):
        per_line = max(1, (1160 // (ncols * size + 16)))
        lines = -(-panels // per_line)
        if ncols * size <= 1160 and lines * (nrows * size + 46) <= 480:
            return size
    return 2


def _verb(role: str, moved: bool) -> str:
    if role == "output":
        return "written back" if moved else "kept (no write-back)"
    return "fetched" if moved else "kept (re-fetch skipped)"


# --- formatting --------------------------------------------------------------------------


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def _tuple(values: object) -> str:
    items = [str(int(v)) for v in np.asarray(values).reshape(-1)]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"
