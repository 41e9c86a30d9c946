#!/usr/bin/env bash
# `tox -e wheels`: builds the six wheels (scripts/build_dists.sh, with `twine check`), installs
# them into a fresh virtual environment outside the repository with their dependencies (jax,
# jaxlib, ...) resolved from the package index, and from a directory outside the repository
# runs scripts/check_installed.py: the README kernel, `python -m pallas_core`, and each plugin
# README's example (a cross-lowering per backend).
# With KEEP_JAX=<version> (tox's wheels environment sets the newest supported JAX), the venv
# first gets that jax and jaxlib, as a user's environment would hold them, and the check fails
# if installing the wheels changed them: pip must never downgrade a user's JAX.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python}"
work="$(mktemp -d "${TMPDIR:-/tmp}/pallas-wheels.XXXXXX")"
trap 'rm -rf "$work"' EXIT
case "$work/" in "$repo"/*) echo "the scratch directory $work is inside $repo" >&2; exit 1;; esac

PYTHON="$PYTHON" bash "$repo/scripts/build_dists.sh" "$work/dist"
# A plain venv from the base interpreter, not the one running tox: nothing of the checkout.
base="$("$PYTHON" -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')"
"$base" -m venv "$work/venv"
unset PYTHONPATH PYTHONHOME
if [ -n "${KEEP_JAX:-}" ]; then
    "$work/venv/bin/python" -m pip install -q "jax==$KEEP_JAX" "jaxlib==$KEEP_JAX"
fi
"$work/venv/bin/python" -m pip install -q --find-links "$work/dist" "$work"/dist/*.whl
if [ -n "${KEEP_JAX:-}" ]; then
    found="$("$work/venv/bin/python" -c 'import jax, jaxlib; print(jax.__version__, jaxlib.__version__)')"
    if [ "$found" != "$KEEP_JAX $KEEP_JAX" ]; then
        echo "installing the wheels changed the environment's JAX from $KEEP_JAX to $found" >&2
        exit 1
    fi
    echo "wheels: the environment's jax and jaxlib $KEEP_JAX were kept"
fi

mkdir "$work/run"
cp "$repo/scripts/check_installed.py" "$repo/scripts/run_md_examples.py" "$work/run/"
cp "$repo/README.md" "$work/run/README.md"
for plugin in "$repo"/plugins/pallas_*/; do
    cp "$plugin/README.md" "$work/run/$(basename "$plugin").md"
done
cd "$work/run"
JAX_PLATFORMS=cpu "$work/venv/bin/python" check_installed.py "$repo" README.md pallas_*.md
echo "wheels: installed from the index into $work/venv and checked outside the repository"
