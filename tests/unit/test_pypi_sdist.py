"""bench/pypi_sdist.py (bench/peers.sh's sdist download) against a real HTTP server on
loopback that serves a PyPI-style project page with a relative file address, as the
mirror here does."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import pypi_sdist

PAYLOAD = b"not really a tarball" * 1000


def _handler(files: dict[str, bytes]) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@pytest.fixture
def index(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, bytes]]:
    files: dict[str, bytes] = {}
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(files))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setattr(pypi_sdist, "INDEX", f"http://127.0.0.1:{srv.server_address[1]}/pypi")
    try:
        yield files
    finally:
        srv.shutdown()
        srv.server_close()


def _page(sha256: str) -> bytes:
    return json.dumps({"releases": {"1.0": [
        {"packagetype": "bdist_wheel", "url": "../../w/pkg-1.0-py3-none-any.whl",
         "filename": "pkg-1.0-py3-none-any.whl", "digests": {"sha256": "0" * 64}},
        {"packagetype": "sdist", "url": "../../files/pkg-1.0.tar.gz",
         "filename": "pkg-1.0.tar.gz", "digests": {"sha256": sha256}}]}}).encode()


def test_downloads_the_sdist_by_its_relative_address_and_checks_it(
        index: dict[str, bytes], tmp_path: Path) -> None:
    index["/pypi/pkg/json"] = _page(hashlib.sha256(PAYLOAD).hexdigest())
    index["/files/pkg-1.0.tar.gz"] = PAYLOAD
    out = pypi_sdist.download("pkg", "1.0", tmp_path)
    assert out == tmp_path / "pkg-1.0.tar.gz" and out.read_bytes() == PAYLOAD
    del index["/files/pkg-1.0.tar.gz"]  # a second call finds the checked file: no download
    assert pypi_sdist.download("pkg", "1.0", tmp_path) == out


def test_a_wrong_digest_leaves_no_file_and_exits_1_with_one_line(
        index: dict[str, bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    index["/pypi/pkg/json"] = _page("f" * 64)
    index["/files/pkg-1.0.tar.gz"] = PAYLOAD
    assert pypi_sdist.main(["pkg", "1.0", str(tmp_path)]) == 1
    assert list(tmp_path.iterdir()) == []
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is not PyPI's" in err
    assert pypi_sdist.main(["pkg", "2.0", str(tmp_path)]) == 1
    assert "has no sdist" in capsys.readouterr().err
