"""mkdocs hook: a link from a page to a file of the repository outside ``docs/`` (``../pallas_core
/hookspecs.py``, ``../../tests/third_party_backend``) becomes a link to that file in the source
repository (``repo_url``), so the Markdown reads the same on GitHub and on the site.

A link to a path that does not exist is left alone, for ``mkdocs build --strict`` to report.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

_LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)\s#]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Rewrites the page's relative links that leave ``docs/`` to source URLs."""
    docs = Path(config["docs_dir"]).resolve()
    root = Path(config["config_file_path"]).resolve().parent
    base = f"{config['repo_url'].rstrip('/')}/"
    here = (docs / page.file.src_path).parent

    def rewrite(match: re.Match[str]) -> str:
        target = Path(os.path.normpath(here / match.group(1)))
        if docs in target.parents or target == docs or root not in target.parents:
            return match.group(0)
        if not target.exists():
            return match.group(0)
        kind = "tree" if target.is_dir() else "blob"
        url = f"{base}{kind}/main/{target.relative_to(root).as_posix()}"
        return f"]({url}{match.group(2) or ''})"

    return _LINK.sub(rewrite, markdown)
