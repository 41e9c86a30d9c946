"""``pl.autotune``'s cache: one JSON file, entries per configuration.

An entry is keyed on the backend, the target chip, the kernel's fingerprint (the hash of the
jaxpr that ``build(**config)`` traces to, for one configuration of the space: the one the
entry names), and the arguments' shapes and dtypes (or the value of ``key=``). Under it, each
configuration (its canonical JSON) has its own record, so that a configuration added to the
space is the only one evaluated. The file is written atomically (a temporary file in the
same folder, then renamed) and merged with what another process wrote meanwhile; a file that
cannot be written (a tuned table shipped read-only inside a package) is only read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import re
import tempfile
from collections.abc import Mapping
from typing import Any

from pallas_core.errors import ArgumentError

FORMAT = "pallas_core.autotune/1"

_replace = os.replace  # the atomic rename (a test makes it fail, as a read-only folder does)


def canonical(value: Any) -> str:
    """Canonical JSON of a configuration or key (sorted keys, no spaces; a value JSON cannot
    hold is written as its ``repr``)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)


def fingerprint(jaxpr_text: str) -> str:
    """The hash of a kernel's jaxpr text, with what changes between runs of the same program
    (object addresses, the source lines kernels were defined at) left out."""
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", jaxpr_text)
    text = re.sub(r"source='[^']*'", "", text)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class Cache:
    """The records of one file (``path=None``: a cache in memory only)."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = pathlib.Path(path) if path is not None else None
        self.entries: dict[str, dict[str, Any]] = self._read()
        self.writable: bool | None = None
        """``False`` once a write failed (a read-only table)."""

    def _read(self) -> dict[str, dict[str, Any]]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ArgumentError(
                f"pl.autotune(cache={str(self.path)!r}): expected a JSON file written by "
                f"pl.autotune, found one that cannot be read ({e}). Fix: delete it, or pass "
                "another path.") from e
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ArgumentError(
                f"pl.autotune(cache={str(self.path)!r}): expected a cache of format "
                f"{FORMAT!r}, found {data.get('format') if isinstance(data, dict) else data!r}"
                ". Fix: delete the file, or pass another path.")
        return dict(data.get("entries", {}))

    @staticmethod
    def key(backend: str | None, target: str | None, kernel: str, args: str) -> str:
        """The part of an entry's key known before any tracing."""
        return canonical([backend, target, kernel, args])

    def candidates(self, partial: str) -> list[tuple[str, dict[str, Any]]]:
        """Entries under ``partial`` (:meth:`key`), each ``(full key, entry)``."""
        return [(k, e) for k, e in self.entries.items() if e.get("partial") == partial]

    def entry(self, partial: str, print_: str, config: Mapping[str, Any]) -> dict[str, Any]:
        """The entry for ``partial`` and fingerprint ``print_`` (made from ``config``),
        created empty if new."""
        full = hashlib.sha256(f"{partial}|{print_}".encode()).hexdigest()[:32]
        return self.entries.setdefault(full, {
            "partial": partial, "fingerprint": print_,
            "fingerprint_config": canonical(config), "configs": {}})

    def save(self) -> str | None:
        """Writes the file, merging records another process added; returns why it could
        not (``None`` when written or when there is no file)."""
        if self.path is None or self.writable is False:
            return None
        try:
            merged = self._read()
        except ArgumentError:
            merged = {}
        for key, entry in self.entries.items():
            old = merged.setdefault(key, {**entry, "configs": {}})
            old["configs"] = {**old.get("configs", {}), **entry["configs"]}
        text = json.dumps({"format": FORMAT, "entries": merged}, indent=1, sort_keys=True)
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text + "\n")
            _replace(tmp, self.path)
        except OSError as e:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            self.writable = False
            return (f"the cache {str(self.path)!r} could not be written ({e}): it was read, "
                    "and this run's results are not saved")
        self.writable = True
        self.entries = merged
        return None
