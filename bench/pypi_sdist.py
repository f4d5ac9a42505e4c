"""Download a package's sdist from PyPI's JSON API and check its sha256 (bench/peers.sh).

    python bench/pypi_sdist.py NAME VERSION DEST_DIR

Prints the file's path. Standard library only: it runs before any venv exists. Every
network read has a timeout, so a stalled mirror fails in minutes with a one-line cause
instead of hanging the peers' install.
"""

from __future__ import annotations

import hashlib
import json
import sys
import urllib.request
from pathlib import Path
from urllib.parse import urljoin

TIMEOUT_S = 60.0  # per network read: a stall, not a slow download, is what it catches
INDEX = "https://pypi.org/pypi"


def sdist_url(name: str, version: str) -> tuple[str, str, str]:
    """(url, filename, sha256) of the release's sdist."""
    # The project's page lists every release (the per-version page is not served by every
    # mirror of the API).
    page = f"{INDEX}/{name}/json"
    with urllib.request.urlopen(page, timeout=TIMEOUT_S) as r:
        project = json.load(r)
    for f in project.get("releases", {}).get(version, []):
        if f.get("packagetype") == "sdist":
            # A mirror may give the file's address relative to the page.
            return urljoin(page, f["url"]), f["filename"], f["digests"]["sha256"]
    raise LookupError(f"{name}=={version} has no sdist on PyPI")


def download(name: str, version: str, dest: Path) -> Path:
    url, filename, sha256 = sdist_url(name, version)
    out = dest / filename
    if out.exists() and hashlib.sha256(out.read_bytes()).hexdigest() == sha256:
        return out
    part = out.with_name(out.name + ".part")
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r, part.open("wb") as f:
        while chunk := r.read(1 << 20):
            digest.update(chunk)
            f.write(chunk)
    if digest.hexdigest() != sha256:
        part.unlink()
        raise ValueError(f"{filename}: sha256 {digest.hexdigest()} is not PyPI's {sha256}")
    part.rename(out)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    name, version, dest = argv
    try:
        print(download(name, version, Path(dest)))
    except (OSError, LookupError, ValueError, KeyError) as exc:
        print(f"error: {name}=={version} sdist: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
