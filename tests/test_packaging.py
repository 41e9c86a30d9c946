"""Packaging metadata of the six distributions (issue 19): one license, one version source
each, plugin dependencies that accept a core bug-fix release, a README per distribution.

These read the ``pyproject.toml`` files of the checkout; the ``dists`` and ``wheels`` tox
environments build the distributions and check what ends up in them.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PROJECTS = {
    "pallas-core": (ROOT, "pallas_core"),
    **{f"pallas-{d.name.removeprefix('pallas_').replace('_', '-')}": (d, d.name)
       for d in sorted((ROOT / "plugins").iterdir()) if (d / "pyproject.toml").exists()},
}


def _pyproject(directory: Path) -> dict:
    return tomllib.loads((directory / "pyproject.toml").read_text())


def test_the_six_distributions_are_found() -> None:
    assert sorted(PROJECTS) == ["pallas-core", "pallas-interpret", "pallas-mosaic-gpu",
                                "pallas-mosaic-tpu", "pallas-sparsecore", "pallas-triton"]


@pytest.mark.parametrize("dist", sorted(PROJECTS))
def test_license_metadata_and_file(dist: str) -> None:
    directory, _ = PROJECTS[dist]
    project = _pyproject(directory)["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    license_text = (directory / "LICENSE").read_text()
    assert license_text == (ROOT / "LICENSE").read_text(), f"{directory}/LICENSE differs"
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text


def _version(dist: str) -> str:
    """The version of ``dist`` as its one source writes it (the literal that setuptools reads
    statically through ``[tool.setuptools.dynamic] version = {attr = ...}``)."""
    directory, _ = PROJECTS[dist]
    data = _pyproject(directory)
    attr = data["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    module, _, name = attr.rpartition(".")
    source = directory / Path(*module.split("."))
    source = source / "__init__.py" if source.is_dir() else source.with_suffix(".py")
    literals = [node.value.value for node in ast.parse(source.read_text()).body
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)]
    assert len(literals) == 1, f"{source} must assign {name} a literal once"
    return str(literals[0])


@pytest.mark.parametrize("dist", sorted(PROJECTS))
def test_version_has_one_source(dist: str) -> None:
    """The version is written once, in the package (read statically by setuptools), and is
    the ``__version__`` the package exports (where this environment has it installed)."""
    directory, package = PROJECTS[dist]
    project = _pyproject(directory)["project"]
    assert "version" not in project and project["dynamic"] == ["version"]
    version = _version(dist)
    Version(version)
    if importlib.util.find_spec(package) is not None:
        assert importlib.import_module(package).__version__ == version


@pytest.mark.parametrize("dist", sorted(set(PROJECTS) - {"pallas-core"}))
def test_plugins_accept_core_bugfix_releases(dist: str) -> None:
    """Plugins depend on a range of first-party versions (``>=0.1,<0.2``), never a pin, and
    the range holds the current version and its next bug-fix release."""
    directory, _ = PROJECTS[dist]
    requirements = [Requirement(r) for r in _pyproject(directory)["project"]["dependencies"]]
    ours = [r for r in requirements if r.name in PROJECTS]
    assert any(r.name == "pallas-core" for r in ours)
    for r in ours:
        current = Version(_version(r.name))
        bugfix = Version(f"{current.major}.{current.minor}.{current.micro + 1}")
        assert "==" not in str(r.specifier) and current in r.specifier, r
        assert bugfix in r.specifier, r


@pytest.mark.parametrize("dist", sorted(PROJECTS))
def test_readme_classifiers_and_urls(dist: str) -> None:
    directory, _ = PROJECTS[dist]
    project = _pyproject(directory)["project"]
    readme = (directory / project["readme"]).read_text()
    assert readme.startswith(f"# {dist}\n")
    # The index page has no commands that only work inside a checkout.
    assert not re.search(r"pip install[^\n]* -e |examples/|\.ci/|tox ", readme), dist
    classifiers = set(project["classifiers"])
    assert {"Typing :: Typed", "Programming Language :: Python :: 3.11",
            "Programming Language :: Python :: 3.12",
            "Programming Language :: Python :: 3.13"} <= classifiers
    assert {"Homepage", "Documentation", "Source", "Issues"} <= set(project["urls"])


def test_triton_is_an_optional_extra() -> None:
    """Lowering needs no triton; only ``pallas-triton[compile]`` brings it, with a bound."""
    project = _pyproject(ROOT / "plugins" / "pallas_triton")["project"]
    assert not any(Requirement(r).name == "triton" for r in project["dependencies"])
    (compile_req,) = [Requirement(r) for r in project["optional-dependencies"]["compile"]]
    assert compile_req.name == "triton" and str(compile_req.specifier) in ("<4,>=3.2",
                                                                          ">=3.2,<4")


@pytest.mark.parametrize("dist", sorted(PROJECTS))
def test_no_distribution_caps_jax(dist: str) -> None:
    """No distribution puts an upper bound on ``jax``/``jaxlib``: pip never downgrades the
    JAX a user already has (issue 28). Every supported release is admitted."""
    directory, _ = PROJECTS[dist]
    for text in _pyproject(directory)["project"].get("dependencies", []):
        r = Requirement(text)
        if r.name in ("jax", "jaxlib"):
            assert not any(s.operator in ("<", "<=", "==", "~=") for s in r.specifier), r
            for supported in ("0.10.2", "0.11.2", "0.12.0.1", "0.13.0"):
                assert Version(supported) in r.specifier, (r, supported)


def test_a_jax_newer_than_tested_warns_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    from pallas_core import _jax

    monkeypatch.setattr(_jax, "JAX_VERSION", (_jax.NEWEST_TESTED_JAX[0],
                                               _jax.NEWEST_TESTED_JAX[1] + 1, 0))
    with pytest.warns(RuntimeWarning, match="tested with JAX up to"):
        _jax.warn_if_untested_jax()
    monkeypatch.setattr(_jax, "JAX_VERSION", (*_jax.NEWEST_TESTED_JAX, 7))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _jax.warn_if_untested_jax()
