"""Checks an installation of the six wheels, from outside the repository (``tox -e wheels``).

``python check_installed.py REPO README.md PLUGIN_README...`` (run from a directory outside the
checkout ``REPO``, in an environment where the wheels were installed with their dependencies
from the package index):

* every ``pallas*`` package is imported from site-packages, none from ``REPO``;
* each distribution carries its license (``License-Expression: Apache-2.0`` and the file) and
  its README as long description;
* the README's kernel (its block under ``## A kernel``) runs and matches ``jax.numpy``;
* ``python -m pallas_core`` lists the five backends, each with its distribution's version;
* each plugin README's example (a kernel run by the interpreter, or lowered for ``cuda`` by
  Triton and Mosaic GPU, for ``tpu`` by Mosaic TPU and SparseCore) runs.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from run_md_examples import run

DISTS = {"pallas-core": "pallas_core", "pallas-interpret": "pallas_interpret",
         "pallas-triton": "pallas_triton", "pallas-mosaic-tpu": "pallas_mosaic_tpu",
         "pallas-mosaic-gpu": "pallas_mosaic_gpu", "pallas-sparsecore": "pallas_sparsecore"}


def check_imports(repo: Path) -> None:
    """Every package comes from this environment's site-packages, not from the checkout."""
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    for dist, package in DISTS.items():
        where = Path(importlib.import_module(package).__file__ or "").resolve()
        if repo in where.parents or site not in where.parents:
            raise SystemExit(f"{package} imported from {where}, not from {site}")
        meta = md.metadata(dist)
        files = [str(f) for f in md.files(dist) or []]
        if meta["License-Expression"] != "Apache-2.0" or not any(
                f.endswith("licenses/LICENSE") for f in files):
            raise SystemExit(f"{dist}: no Apache-2.0 license expression or LICENSE file")
        if not (meta.get_payload() or "").startswith(f"# {dist}\n"):  # type: ignore[attr-defined]
            raise SystemExit(f"{dist}: its README is not its long description")
        print(f"{dist} {md.version(dist)}: {where.parent}")


def run_readme_kernel(readme: Path) -> None:
    """The block under ``## A kernel`` in the repository README, on random inputs."""
    import jax
    import numpy as np

    section = readme.read_text().split("## A kernel", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, "no python block under '## A kernel'"
    namespace: dict[str, object] = {}
    exec(code.group(1), namespace)
    x, y = jax.random.normal(jax.random.key(0), (2, 1000))
    out = namespace["add"](x, y)  # type: ignore[operator]
    np.testing.assert_allclose(np.asarray(out), np.asarray(x + y), rtol=1e-6)
    print(f"{readme}: the README kernel matches jax.numpy")


def check_listing() -> None:
    """``python -m pallas_core`` lists every backend with its version and exits 0."""
    done = subprocess.run([sys.executable, "-m", "pallas_core"], capture_output=True, text=True)
    print(done.stdout, end="")
    if done.returncode:
        raise SystemExit(f"python -m pallas_core failed:\n{done.stderr}")
    for dist in set(DISTS) - {"pallas-core"}:
        if not re.search(rf" {re.escape(md.version(dist))} +{dist} ", done.stdout):
            raise SystemExit(f"{dist} {md.version(dist)} is not listed")


def main(argv: list[str]) -> int:
    repo = Path(argv[0]).resolve()
    if repo in Path.cwd().resolve().parents or Path.cwd().resolve() == repo:
        raise SystemExit("run this from outside the repository")
    check_imports(repo)
    run_readme_kernel(Path(argv[1]))
    check_listing()
    for name in argv[2:]:
        print(f"{name}: {run(Path(name))} example block(s) ran")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
