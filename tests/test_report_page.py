"""``Report.save``'s page of pictures and ``python -m pallas_core report``: the page is
self-contained, draws one block map per operand whose cells are the steps the pipeline moves
and keeps, a roofline point per kernel and chip and the footprint bar; the command line
writes it and refuses bad input with exit status 2; and headless Chromium renders the roofline
chart and every block map (skipped where Chromium is absent: `.ci/run` installs it in CI)."""

from __future__ import annotations

import html.parser
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl
from pallas_core import report_page
from pallas_core.__main__ import main, parse_shape

pltpu = pytest.importorskip("pallas_mosaic_tpu")

REPO = pathlib.Path(__file__).resolve().parent.parent
X = jax.ShapeDtypeStruct((32, 384), jnp.float32)
W = jax.ShapeDtypeStruct((32, 128), jnp.float32)
A = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)


def _scale(x: Any, w: Any) -> Any:
    """Grid (4, 3): x's block moves at every step, w's (i, 0) only when i does."""
    return pl.pallas_call(
        lambda x_ref, w_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * w_ref[...]),
        jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4, 3),
        in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j)),
                  pl.BlockSpec((8, 128), lambda i, j: (i, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, j)), backend="mosaic_tpu")(x, w)


def _two_kernels(x: Any, w: Any, a: Any) -> Any:
    from examples.report_matmul import matmul

    return _scale(x, w), matmul(a, a)  # the second on a grid (2, 2, 2)


class _Elements(html.parser.HTMLParser):
    """Every start tag with its attributes and the ``svg`` it lies in."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str], dict[str, str] | None]] = []
        self._svg: dict[str, str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "svg":
            self._svg = a
        self.found.append((tag, a, self._svg))

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._svg = None


def _elements(page: str, tag: str, cls: str) -> list[tuple[dict[str, str], dict[str, str]]]:
    parser = _Elements()
    parser.feed(page)
    return [(a, svg or {}) for t, a, svg in parser.found
            if t == tag and cls in a.get("class", "").split()]


@pytest.fixture(scope="module")
def report() -> pl.Report:
    return pl.report(_two_kernels, X, W, A, target=["v5e", "h100"])


@pytest.fixture(scope="module")
def page(report: pl.Report, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("page") / "kernel.html"
    assert report.save(path) == path
    return path


def test_the_page_is_self_contained(page: pathlib.Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert set(re.findall(r"https?://[^\s\"'<>)]+", text)) <= {"http://www.w3.org/2000/svg"}
    assert not re.search(r"<script|<link|<img|<iframe|@import", text, re.IGNORECASE)
    assert set(re.findall(r"url\(([^)]*)\)", text)) <= {m for m in re.findall(
        r"url\((#[-\w]+)\)", text)}  # only the page's own patterns
    assert "<pre>" in text and "kernel &#x27;kernel&#x27; on mosaic_tpu" in text


def test_one_block_map_per_operand_with_a_cell_per_step(report: pl.Report,
                                                        page: pathlib.Path) -> None:
    """Each cell is one grid step (nothing is binned here): dark where the pipeline moves
    the operand's block, light where the step keeps the previous one."""
    text = page.read_text(encoding="utf-8")
    maps = _elements(text, "svg", "block-map")
    expected = [(str(i), o.name) for i, k in enumerate(report) for o in k.operands]
    assert [(a["data-kernel"], a["data-operand"]) for a, _ in maps] == expected
    for i, k in enumerate(report):
        for o in k.operands:
            assert o.moved is not None
            cells = [a["class"].split()[1] for a, svg in _elements(text, "rect", "cell")
                     if (svg.get("data-kernel"), svg.get("data-operand")) == (str(i), o.name)]
            assert cells.count("moved") == o.blocks == int(o.moved.sum()), o.name
            assert cells.count("kept") == o.skipped == int((~o.moved).sum()), o.name
    w = next(o for o in report[0].operands if "w_ref" in o.name)
    assert (w.blocks, w.skipped) == (4, 8)
    # The grid (2, 2, 2) of the matmul: small multiples over its outer axis.
    assert text.count("grid (0, :, :)") == text.count("grid (1, :, :)") == 3


def test_a_roofline_point_per_kernel_and_chip_and_a_roof_per_chip(page: pathlib.Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert len(_elements(text, "svg", "roofline")) == 1
    points = {(a["data-kernel"], a["data-chip"]) for a, _ in
              _elements(text, "circle", "roofline-point")}
    assert points == {(k, c) for k in "01" for c in ("v5e", "h100")}
    assert {a["data-chip"] for a, _ in _elements(text, "g", "roof")} == {"v5e", "h100"}
    assert "ridge 240" in text  # v5e's bfloat16 peak over its bandwidth


def test_the_footprint_bar_and_a_kernel_that_does_not_fit(page: pathlib.Path,
                                                          tmp_path: pathlib.Path) -> None:
    text = page.read_text(encoding="utf-8")
    bars = _elements(text, "svg", "footprint")
    assert [(a["data-kernel"], a["data-fits"]) for a, _ in bars] == [("0", "true"),
                                                                      ("1", "true")]
    assert "4 MiB of the 16 MiB limit (25%): fits" in text  # the matmul's four 1 MiB parts

    def copy(x: Any) -> Any:
        spec = pl.BlockSpec((2048, 2048), lambda i: (i, 0))
        return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
                              jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
                              in_specs=[spec], out_specs=spec, backend="mosaic_tpu")(x)

    big = pl.report(copy, jax.ShapeDtypeStruct((8192, 2048), jnp.float32))
    text = big.save(tmp_path / "big.html").read_text(encoding="utf-8")
    assert [a["data-fits"] for a, _ in _elements(text, "svg", "footprint")] == ["false"]
    assert "does NOT fit" in text and _elements(text, "rect", "over-limit")
    assert "Not on the chart: &lt;lambda&gt; does no FLOPs" in text


def test_large_grids_are_binned_and_say_so() -> None:
    def rows(x: Any) -> Any:
        spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
        return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2),
                              jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(64, 64),
                              in_specs=[spec], out_specs=spec, backend="mosaic_tpu")(x)

    text = report_page.page(pl.report(rows, jax.ShapeDtypeStruct((512, 8192), jnp.float32)))
    assert "binned: 16 steps per column, 43 blocks per row" in text
    cells = _elements(text, "rect", "cell")
    assert 0 < len(cells) <= 2 * report_page.MAX_STEPS * report_page.MAX_ROWS


def test_scalar_prefetch_indices_are_marked_sampled_or_given() -> None:
    def gather(idx: Any, x: Any) -> Any:
        return pl.pallas_call(
            lambda idx_ref, x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
            jax.ShapeDtypeStruct((16 * 8, 128), x.dtype),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(16,),
                in_specs=[pl.BlockSpec((8, 128), lambda i, idx: (idx[i], 0))],
                out_specs=pl.BlockSpec((8, 128), lambda i, idx: (i, 0))),
            backend="mosaic_tpu")(idx, x)

    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    sampled = report_page.page(pl.report(gather, jax.ShapeDtypeStruct((16,), jnp.int32), x))
    maps = {a["data-operand"]: a["data-index-source"]
            for a, _ in _elements(sampled, "svg", "block-map")}
    assert maps["input 1 (x_ref)"] == "sampled"
    assert _elements(sampled, "rect", "sampled") and "drawn at random" in sampled
    assert "No block map: a scalar-prefetch operand" in sampled
    given = report_page.page(pl.report(gather, np.arange(16, dtype=np.int32) % 8, x))
    assert {a["data-operand"]: a["data-index-source"] for a, _ in _elements(
        given, "svg", "block-map")}["input 1 (x_ref)"] == "given"
    assert "indices from the scalar-prefetch values given" in given


def test_save_refuses_a_directory(report: pl.Report, tmp_path: pathlib.Path) -> None:
    with pytest.raises(pl.PallasError, match="expected a file name, found a directory"):
        report.save(tmp_path)


# --- the command line --------------------------------------------------------------------


def test_the_command_line_prints_the_table_and_writes_the_page(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "kernel.html"
    done = subprocess.run(
        [sys.executable, "-m", "pallas_core", "report", "examples.report_matmul:matmul",
         "--backend", "mosaic_tpu", "--target", "v5e", "--target", "v6e", "--out", str(out),
         "bf16[1024,1024]", "bf16[1024,1024]"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "kernel 'kernel' on mosaic_tpu: grid (2, 2, 2) (8 steps)" in done.stdout
    assert f"wrote {out}" in done.stdout
    text = out.read_text(encoding="utf-8")
    assert len(_elements(text, "svg", "block-map")) == 3
    assert {a["data-chip"] for a, _ in _elements(text, "circle", "roofline-point")} == {
        "v5e", "v6e"}


@pytest.mark.parametrize("argv, message", [
    (["examples.no_such_module:matmul", "f32[8]"],
     "no module named 'examples.no_such_module' (looked in the current directory"),
    (["examples.report_matmul:matmul", "bf16(8,8)", "bf16[8,8]"],
     "shape 'bf16(8,8)': expected DTYPE[D0,D1,...], e.g. bf16[4096,4096]"),
    (["examples.report_matmul:matmul", "q7[8]", "bf16[8,8]"], "'q7' is not a dtype. Fix:"),
    (["examples.report_matmul", "bf16[8,8]"], "expected MODULE:FUNCTION"),
    (["examples.report_matmul:matmal", "bf16[8,8]"],
     "has no 'matmal'. Fix: name one of its functions: main, matmul"),
    (["examples.report_matmul:matmul", "bf16[512,512]"],
     "1 shape(s) given for matmul(a, b): missing a required argument: 'b'"),
    (["examples.report_matmul:matmul", "--target", "v9", "bf16[512,512]", "bf16[512,512]"],
     "'v9' is not a chip any loaded backend lists. Fix: use one of"),
])
def test_bad_input_exits_2_saying_what_was_expected(argv: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Returned, not raised: ``python -m`` prints the message alone, no traceback."""
    monkeypatch.chdir(REPO)
    assert main(["report", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m pallas_core report: error: ") and message in err, err
    assert "Fix:" in err


def test_shapes_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_shape("bf16[4096, 4096]") == jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    assert parse_shape("i32[8]") == jax.ShapeDtypeStruct((8,), jnp.int32)
    assert parse_shape("float32[]") == jax.ShapeDtypeStruct((), jnp.float32)
    for flag in ("--version", "--help"):
        with pytest.raises(SystemExit) as done:
            main([flag])
        assert done.value.code == 0
    out = capsys.readouterr().out
    assert f"pallas-core {pl.__version__} (jax {jax.__version__})" in out
    assert "report" in out and "COMMAND" in out


# --- in a real browser -------------------------------------------------------------------


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _read_png(path: pathlib.Path) -> np.ndarray:
    """An 8-bit RGB(A), non-interlaced PNG (what Chromium writes) as an (h, w, 3) array."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], b""
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IHDR":
            header = data[pos + 8:pos + 8 + n]
        elif kind == b"IDAT":
            idat.append(data[pos + 8:pos + 8 + n])
        pos += 12 + n
    w, h, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and colour in (2, 6) and not interlace, (depth, colour, interlace)
    bpp = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(h, w * bpp + 1)
    out = np.zeros((h, w * bpp), np.uint8)
    prev = np.zeros(w * bpp, np.uint8)
    for r in range(h):
        kind, line = int(raw[r, 0]), raw[r, 1:]
        if kind == 0:
            out[r] = line
        elif kind == 1:  # sub: a running sum along the row, per channel
            out[r] = np.cumsum(line.reshape(w, bpp), axis=0, dtype=np.uint8).reshape(-1)
        elif kind == 2:  # up
            out[r] = line + prev
        else:  # average or Paeth: byte by byte
            out[r] = _unfilter(kind, line.tolist(), prev.tolist(), bpp)
        prev = out[r]
    return out.reshape(h, w, bpp)[:, :, :3]


def _unfilter(kind: int, cur: list[int], up: list[int], bpp: int) -> list[int]:
    for i in range(len(cur)):
        a = cur[i - bpp] if i >= bpp else 0
        b = up[i]
        if kind == 3:
            cur[i] = (cur[i] + ((a + b) >> 1)) & 255
            continue
        c = up[i - bpp] if i >= bpp else 0
        pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - c - c)
        cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    return cur


def _mask(image: np.ndarray, colour: str, tolerance: int = 6) -> np.ndarray:
    rgb = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
    return np.all(np.abs(image.astype(int) - rgb) <= tolerance, axis=-1)


def _bands(rows: np.ndarray) -> list[tuple[int, int]]:
    """Runs of consecutive row numbers (gaps of a few rows are one run)."""
    bands: list[tuple[int, int]] = []
    for r in np.flatnonzero(rows).tolist():
        if bands and r - bands[-1][1] <= 3:
            bands[-1] = (bands[-1][0], r)
        else:
            bands.append((r, r))
    return bands


def test_chromium_renders_the_roofline_and_every_block_map(tmp_path: pathlib.Path) -> None:
    chromium = _chromium()
    if chromium is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium; .ci/run "
                    "installs it in CI)")
    report = pl.report(_scale, X, W, target=["v5e", "h100"])
    page, shot = report.save(tmp_path / "page.html"), tmp_path / "page.png"
    done = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars",
         f"--screenshot={shot}", "--window-size=1000,1800", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert shot.exists(), f"no screenshot: {done.returncode}\n{done.stderr[-2000:]}"
    image = _read_png(shot)

    chart = _mask(image, report_page.ROOF_BACKGROUND)
    rows, cols = _bands(chart.sum(axis=1) >= 200), _bands(chart.sum(axis=0) >= 200)
    assert len(rows) == len(cols) == 1, "the roofline chart's plot area is not on the page"
    (top, bottom), (left, right) = rows[0], cols[0]
    assert (bottom - top, right - left) >= (300, 500)  # drawn 640 x 360
    area = image[top:bottom + 1, left:right + 1]
    for colour in ("#6a1b9a", "#00897b"):  # the first two chips' roofs and points
        assert _mask(area, colour, 24).sum() > 50, f"no {colour} in the roofline chart"

    maps = _bands(_mask(image, report_page.MAP_BACKGROUND).sum(axis=1) >= 20)
    assert len(maps) == len(report[0].operands) == 3, maps
    assert all(lo > bottom for lo, _ in maps)  # below the chart
    for (lo, hi), o in zip(maps, report[0].operands, strict=True):
        band = image[lo:hi + 1]
        role = "output" if o.role == "output" else "input"
        assert _mask(band, report_page.MOVED[role]).sum() >= o.blocks * 100, o.name
        if o.skipped:
            assert _mask(band, report_page.KEPT[role]).sum() >= o.skipped * 100, o.name
