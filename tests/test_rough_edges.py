"""The rough edges a new user hit (issue 33), each checked against what the user should see.

* ``pl.emulate`` refuses a kernel its backend cannot lower with ``pl.stages``' message (the
  cause), not with what the lowering trips over first;
* a store of the wrong dtype or shape says what the Ref holds, what the value is, the fix, and
  the store's line;
* what ``pl.stages`` returns for a kernel iterates, has a length and is indexed by position;
* ``python -m pallas_core`` takes ``--help``, ``--version`` and ``--json``;
* checked mode's error is printed once (JAX's log of the host callback's exception is left out);
* the Triton, Mosaic TPU and backend-guide pages say what the code does;
* the README's portable scratch snippets run and lower as the README says.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import logging
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl
from pallas_core import __main__ as cli
from pallas_core.errors import OutOfBoundsError, PallasError, StageNotFoundError
from pallas_core.plugins import manager

ROOT = Path(__file__).resolve().parents[1]


def _line_of(fn: Any, text: str) -> str:
    """``file:line`` of the first line of ``fn``'s source that contains ``text``."""
    lines, first = inspect.getsourcelines(fn)
    number = next(first + i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(fn)}:{number}"


# --- pl.emulate names the cause, as pl.stages does -----------------------------------------


def test_emulate_refuses_a_foreign_memory_space_with_the_message_of_stages() -> None:
    """TPU scratch on the Triton backend: ``pl.stages`` names the memory space; ``pl.emulate``
    used to fail inside the lowering (``UnsupportedError: swap on float32 (KeyError: Var...``)."""
    pltpu = pytest.importorskip("pallas_mosaic_tpu")
    pytest.importorskip("pallas_triton")

    def kernel(x_ref: Any, o_ref: Any, s_ref: Any) -> None:
        s_ref[...] = x_ref[...] * 2
        o_ref[...] = s_ref[...] + 1

    def f(x: Any) -> Any:
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              scratch_shapes=[pltpu.VMEM(x.shape, x.dtype)])(x)

    x = jnp.ones((16, 128), jnp.float32)
    with pytest.raises(pl.UnsupportedError) as staged:
        pl.stages(f, x, backend="triton", target="sm_90")
    with pytest.raises(pl.UnsupportedError) as emulated:
        pl.emulate(f, backend="triton", target="sm_90")(x)
    assert str(emulated.value) == str(staged.value)
    assert "mosaic_tpu.VMEM" in str(emulated.value) and "Fix" in str(emulated.value)


# --- store mismatches ----------------------------------------------------------------------


def _trace_error(kernel: Any, out: jax.ShapeDtypeStruct) -> str:
    x = jnp.ones((16, 128), jnp.float32)
    with pytest.raises(pl.KernelTraceError) as e:
        pl.pallas_call(kernel, out_shape=out)(x)
    return str(e.value)


def test_store_of_another_dtype_says_expected_found_fix_and_line() -> None:
    def kernel(x_ref: Any, o_ref: Any) -> None:
        x = x_ref[...] * 2
        o_ref[...] = x

    msg = _trace_error(kernel, jax.ShapeDtypeStruct((16, 128), jnp.int32))
    assert _line_of(kernel, "o_ref[...] = x") in msg
    assert "`o_ref[...] = x`" in msg
    assert "float32 value into a Ref of int32" in msg
    assert "Fix" in msg and "o_ref[...] = value.astype(o_ref.dtype)" in msg
    assert "Invalid dtype" not in msg


@pytest.mark.parametrize("store,expected,found", [
    ("o_ref[...] = x[:8]", (16, 128), (8, 128)),
    ("o_ref[0:8, :] = x", (8, 128), (16, 128)),
])
def test_store_of_another_shape_says_expected_found_fix_and_line(
        store: str, expected: tuple[int, ...], found: tuple[int, ...]) -> None:
    def whole(x_ref: Any, o_ref: Any) -> None:
        x = x_ref[...]
        o_ref[...] = x[:8]

    def view(x_ref: Any, o_ref: Any) -> None:
        x = x_ref[...]
        o_ref[0:8, :] = x

    kernel = whole if store.startswith("o_ref[...]") else view
    msg = _trace_error(kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32))
    assert _line_of(kernel, store) in msg
    assert f"a value of shape {found} into a Ref (or view) of shape {expected}" in msg
    assert "Fix" in msg and "pl.ds" in msg
    assert "Invalid shape" not in msg


# --- KernelStages --------------------------------------------------------------------------


def test_stages_iterate_kernels_and_each_kernel_its_stages() -> None:
    pytest.importorskip("pallas_mosaic_tpu")

    def add_one(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] + 1

    def double(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...] * 2

    def f(x: Any) -> Any:
        out = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return pl.pallas_call(double, out_shape=out)(pl.pallas_call(add_one, out_shape=out)(x))

    found = pl.stages(f, jnp.ones((8, 128), jnp.float32), backend="mosaic_tpu", target="v5e")
    assert [k.name for k in found] == ["add_one", "double"] and len(found) == 2
    kernel = found[0]
    names = list(kernel.stages)  # the mapping the backend's hook and the core filled
    assert names[:2] == ["jaxpr", "stablehlo"] and "mosaic" in names
    assert list(kernel) == names and len(kernel) == len(names)
    assert [name for name, _ in kernel.items()] == names
    assert kernel[0] == kernel["jaxpr"] == str(kernel.stages["jaxpr"])
    assert "add_one" in kernel[0] or "add" in kernel[0]
    assert kernel[-1] is kernel[names[-1]]
    assert "mosaic" in kernel and "ptx" not in kernel
    for bad in (len(names), "ptx"):
        with pytest.raises(StageNotFoundError, match="Fix"):
            kernel[bad]
    assert issubclass(StageNotFoundError, (KeyError, IndexError, PallasError))
    assert kernel.get("ptx") is None


# --- python -m pallas_core -----------------------------------------------------------------


def test_cli_json_lists_the_backends_as_the_manager_has_them(capsys: Any) -> None:
    status = cli.main(["--json"])
    listing = json.loads(capsys.readouterr().out)
    assert status == (1 if manager.errors() else 0)
    assert listing["pallas_core"] == pl.__version__ and listing["jax"] == jax.__version__
    loaded = manager.backends()
    assert sorted(listing["backends"]) == sorted(loaded)
    for name, backend in loaded.items():
        entry, info = listing["backends"][name], backend.info
        assert entry["version"] == info.version
        assert entry["platforms"] == list(info.platforms)
        assert entry["default_for"] == list(info.default_for)
        assert set(entry["capabilities"]) == {str(getattr(c, "value", c))
                                              for c in info.capabilities}
    assert set(listing["errors"]) == set(manager.errors())


@pytest.mark.parametrize("flag,expected", [("--help", "--json"), ("--version", "pallas-core")])
def test_cli_help_and_version(flag: str, expected: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main([flag])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert expected in out
    if flag == "--version":
        assert out.strip() == f"pallas-core {pl.__version__} (jax {jax.__version__})"


# --- checked mode prints its report once ---------------------------------------------------


def test_checked_mode_error_is_not_logged_before_it_is_raised(caplog: Any) -> None:
    """JAX logs an exception raised in a host callback with its traceback; checked mode's
    report is raised again by ``pallas_call`` itself, so that log only printed it twice."""
    interpret = pytest.importorskip("pallas_interpret")

    def kernel(x_ref: Any, o_ref: Any) -> None:
        o_ref[pl.ds(x_ref[0], 8)] = jnp.ones((8,), jnp.float32)

    f = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                       interpret=interpret.InterpretParams(checked=True))
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(OutOfBoundsError, match="Out-of-bounds write"):
            jax.block_until_ready(f(jnp.array([12], jnp.int32)))
        jax.effects_barrier()
    logged = [r for r in caplog.records
              if r.exc_info and isinstance(r.exc_info[1], PallasError)]
    assert logged == [], [r.getMessage() for r in logged]


# --- docs ----------------------------------------------------------------------------------


def test_triton_page_installs_what_the_plugin_declares() -> None:
    """Whether the ``triton`` package comes with ``pallas-triton`` is the plugin's
    ``pyproject.toml``'s to say; the page must say the same."""
    project = tomllib.loads((ROOT / "plugins/pallas_triton/pyproject.toml").read_text())
    required = any(re.match(r"triton\b", d) for d in project["project"]["dependencies"])
    extras = [name for name, deps in project["project"]["optional-dependencies"].items()
              if any(re.match(r"triton\b", d) for d in deps)]
    page = (ROOT / "docs/backends/triton.md").read_text()
    sentences = re.split(r"(?<=[.;])\s", page.replace("\n", " "))
    claims = [s for s in sentences if "`triton` package" in s and "comes with" in s
              and "not come" not in s]
    assert required or not claims, claims
    for extra in extras:
        assert f"pallas-triton[{extra}]" in page


def test_mosaic_tpu_page_points_to_the_sparsecore_backend() -> None:
    assert (ROOT / "plugins/pallas_sparsecore/pyproject.toml").exists()
    page = (ROOT / "docs/backends/mosaic_tpu_api.md").read_text()
    assert not re.search(r"no SparseCore support", page, re.I)
    assert "(sparsecore.md)" in page and (ROOT / "docs/backends/sparsecore.md").exists()


def _guide_section_1() -> str:
    guide = (ROOT / "docs/writing-a-backend.md").read_text()
    return guide.split("## 1. ")[1].split("\n## 2. ")[0]


def _guide_files(section: str) -> dict[str, str]:
    """The files section 1 of the backend guide gives, by path in its tree."""
    tree = re.search(r"```text\n(.*?)```", section, re.S)
    assert tree is not None
    paths, stack = [], []
    for line in tree.group(1).splitlines()[1:]:
        name = re.sub(r"^[│├└─\s]+", "", line).split("#")[0].strip()
        depth = (len(line) - len(line.lstrip("│├└─ "))) // 4 - 1  # under the root folder
        stack = [*stack[:depth], name.rstrip("/")]
        if not name.endswith("/"):
            paths.append("/".join(stack))
    blocks = re.findall(r"(?:`([^`\n]+)`[^`\n]*:?\n\n)?```(toml|python)\n(.*?)```", section, re.S)
    files = {}
    for path in paths:
        named = [code for label, _, code in blocks if label and label.endswith(path)]
        kind = "toml" if path.endswith(".toml") else "python"
        unnamed = [code for label, k, code in blocks if k == kind]
        files[path] = named[0] if named else unnamed[0]
    return files


def test_backend_guide_says_how_many_files_it_gives_and_imports_only_what_it_uses() -> None:
    section = _guide_section_1()
    files = _guide_files(section)
    words = {2: "Two", 3: "Three", 4: "Four"}
    assert f"{words[len(files)]} files" in section, sorted(files)
    assert "pallas_my_backend/__init__.py" in files and "pyproject.toml" in files
    for path, code in files.items():
        if not path.endswith(".py"):
            continue
        tree = ast.parse(code)
        imported = {(a.asname or a.name).split(".")[0]: a.name
                    for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                    for a in node.names if a.name != "annotations"}
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert set(imported) <= used, (path, set(imported) - used)


def test_backend_guide_code_runs_as_written(tmp_path: Path) -> None:
    """Section 1's backend, loaded from the guide's text, runs a kernel, and its test module
    runs the conformance suite on it (the full suite is run from a fresh clone by hand: the
    guide's own commands)."""
    files = _guide_files(_guide_section_1())
    project = tomllib.loads(files["pyproject.toml"])
    name, target = next(iter(project["project"]["entry-points"]["pallas.backends"].items()))
    source = tmp_path / "pallas_my_backend.py"
    source.write_text(files["pallas_my_backend/__init__.py"])
    spec = importlib.util.spec_from_file_location(target, source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[target] = module
    try:
        spec.loader.exec_module(module)
        manager.register(module, name)
        x = jnp.arange(256, dtype=jnp.float32).reshape(16, 16)

        def kernel(x_ref: Any, o_ref: Any) -> None:
            o_ref[...] = x_ref[...] * 2 + 1

        out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                             grid=(2,), in_specs=[pl.BlockSpec((8, 16), lambda i: (i, 0))],
                             out_specs=pl.BlockSpec((8, 16), lambda i: (i, 0)),
                             backend=name)(x)
        np.testing.assert_array_equal(out, np.asarray(x) * 2 + 1)
        suite: dict[str, Any] = {}
        exec(compile(files["tests/test_conformance.py"], "test_conformance.py", "exec"), suite)
        classes = [c for n, c in suite.items() if n.startswith("Test") and isinstance(c, type)]
        assert [c.backend for c in classes] == [name]
    finally:
        if name in manager.backends():
            manager.unregister(name)
        sys.modules.pop(target, None)


# --- the README's portable scratch idiom ---------------------------------------------------


@pytest.fixture(scope="module")
def readme_snippets() -> dict[str, Any]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Scratch memory that works on every backend")[1].split("\n## ")[0]
    namespace: dict[str, Any] = {}
    for block in re.findall(r"```python\n(.*?)```", section, re.S):
        exec(compile(block, "README.md", "exec"), namespace)
    return namespace


def _operands() -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(0), (128, 256), jnp.float32).astype(jnp.bfloat16)
    y = jax.random.normal(jax.random.key(1), (256, 128), jnp.float32).astype(jnp.bfloat16)
    return x, y


@pytest.mark.parametrize("fn", ["matmul", "matmul_bf16"])
def test_readme_scratch_snippets_run_in_the_interpreter(readme_snippets: dict[str, Any],
                                                        fn: str) -> None:
    x, y = _operands()
    out = readme_snippets[fn](x, y, backend="interpret")
    expected = np.asarray(x, np.float32) @ np.asarray(y, np.float32)
    assert out.dtype == (jnp.float32 if fn == "matmul" else jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("backend,target,stage", [("mosaic_tpu", "v5e", "mosaic"),
                                                  ("mosaic_gpu", "sm_90a", "mosaic_gpu")])
@pytest.mark.parametrize("fn", ["matmul", "matmul_bf16"])
def test_readme_scratch_snippets_lower_for_tpu_and_mosaic_gpu(
        readme_snippets: dict[str, Any], fn: str, backend: str, target: str,
        stage: str) -> None:
    pytest.importorskip(f"pallas_{backend}")
    found = pl.stages(lambda a, b: readme_snippets[fn](a, b, backend=backend), *_operands(),
                      backend=backend, target=target)
    assert [k.name for k in found] == [f"{fn}_kernel"]
    assert found[0][stage]  # made when read: the kernel lowers


def test_readme_portable_snippet_lowers_for_triton(readme_snippets: dict[str, Any]) -> None:
    pytest.importorskip("pallas_triton")
    x, y = _operands()

    def f(a: Any, b: Any) -> Any:
        return readme_snippets["matmul"](a, b, backend="triton")

    if importlib.util.find_spec("triton") is not None:  # pallas-triton[compile]
        found = pl.stages(f, x, y, backend="triton", target="sm_90")
        assert "tt.dot" in found[0]["ttir"] and found[0]["cubin"]
    else:  # without the compiler, the lowering pl.stages starts from
        text = jax.jit(f).trace(x, y).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text
    # The scratch version is refused, pointing at the portable one.
    with pytest.raises(pl.UnsupportedError, match="output block"):
        pl.stages(lambda a, b: readme_snippets["matmul_bf16"](a, b, backend="triton"), x, y,
                  backend="triton", target="sm_90")
