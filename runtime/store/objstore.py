"""An engine store's objects through obstore: S3 (any S3 API: AWS, MinIO, Ceph, SeaweedFS,
R2) or a local directory, with retries, a deadline, and errors that name the object.

S3 settings come from the standard environment: `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_REGION` (and the rest obstore reads). Every failure becomes
one StoreError line: which object, and whether it is missing, the credentials were refused,
the endpoint could not be reached (after retries, within the deadline), or something else.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from datetime import timedelta
from pathlib import Path
from typing import Any

from contract.errors import EXIT_FAILURE, BuildError
from contract.refs import is_remote, split_s3
from runtime.env import STORE_DEADLINE, number

Buffer = Any  # bytes-like (obstore's Bytes, memoryview): collections.abc.Buffer is 3.12+

# How long one operation (with its retries) may take before the start gives up; a store
# that goes away mid-read ends the read within about this long.
DEFAULT_DEADLINE_S = 30.0
DEADLINE_ENV = STORE_DEADLINE.name
PART_BYTES = 8 << 20  # ranged reads of this size, several at once
CONCURRENCY = 8


class StoreError(BuildError):
    """A store operation failed: `kind` is missing | credentials | unreachable | other."""

    def __init__(self, cause: str, remedy: str, kind: str) -> None:
        super().__init__(cause, remedy, exit_code=EXIT_FAILURE)
        self.kind = kind


def deadline_s() -> float:
    try:
        return max(1.0, number(STORE_DEADLINE))
    except ValueError:
        return DEFAULT_DEADLINE_S


def endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT") or "AWS S3"


_S3_CODE = re.compile(r"<Code>([^<]+)</Code>")
_RETRIES = re.compile(r"after (\d+) retries")


def _summary(e: BaseException) -> str:
    """The useful part of an obstore error: the S3 error code or the HTTP failure."""
    text = str(e)
    code = _S3_CODE.search(text)
    status = re.search(r"status code: (\d{3}[^:<]*)", text)
    if code:
        return f"{status.group(1).strip() + ' ' if status else ''}{code.group(1)}"
    if status:
        return status.group(1).strip()
    first = text.split("\n", 1)[0]
    return " ".join(first.split())[:300]


def _unreachable_cause(e: BaseException) -> str:
    text = str(e)
    if "kind: Connect" in text or "Connection refused" in text or "error sending request" in text:
        why = "connection refused or reset"
    elif "kind: Timeout" in text or "timed out" in text.lower():
        why = "timed out"
    elif "kind: Body" in text or "kind: Decode" in text or "error decoding" in text.lower():
        why = "the connection broke mid-transfer"
    else:
        why = _summary(e)
    n = _RETRIES.search(text)
    return f"{why}{f' after {n.group(1)} retries' if n else ''}"


class ObjectStore:
    """One store root: `s3://bucket[/prefix]` or a local directory."""

    def __init__(self, root: str | Path, deadline: float | None = None) -> None:
        import obstore.store as st

        self.root = str(root).rstrip("/") or "/"
        self.remote = is_remote(self.root)
        self.deadline = deadline_s() if deadline is None else deadline
        if self.remote:
            bucket, prefix = split_s3(self.root)
            retry = {"max_retries": 10, "retry_timeout": timedelta(seconds=self.deadline),
                     "backoff": {"init_backoff": timedelta(milliseconds=100),
                                 "max_backoff": timedelta(seconds=2), "base": 2}}
            client: dict[str, Any] = {
                "connect_timeout": timedelta(seconds=min(5.0, self.deadline)),
                "timeout": timedelta(seconds=self.deadline)}
            if endpoint().startswith("http://"):
                client["allow_http"] = True
            self._store: Any = st.S3Store(bucket, prefix=prefix or None, client_options=client,
                                          retry_config=retry)  # type: ignore[arg-type]
        else:
            path = Path(self.root).expanduser().absolute()
            self._store = st.LocalStore(path, mkdir=True)

    def url(self, key: str) -> str:
        return f"{self.root}/{key}"

    # ---- errors ----------------------------------------------------------------------

    def error(self, e: BaseException, key: str, op: str) -> StoreError:
        import obstore.exceptions as x

        where = self.url(key)
        if isinstance(e, StoreError):
            return e
        if isinstance(e, (FileNotFoundError, x.NotFoundError)):
            return StoreError(f"{where}: no such object ({_summary(e)})",
                              "push the engine again (`pipeline push`), or check the name",
                              "missing")
        if isinstance(e, (x.PermissionDeniedError, x.UnauthenticatedError, PermissionError)):
            return StoreError(
                f"{op} {where}: the store refused the credentials ({_summary(e)})",
                "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the key's rights",
                "credentials")
        if self.remote and isinstance(e, x.GenericError):
            text = str(e)
            if "status code: 4" not in text and "status code: 5" not in text:
                return StoreError(
                    f"{op} {where}: endpoint {endpoint()} unreachable ({_unreachable_cause(e)}, "
                    f"deadline {self.deadline:.0f} s)",
                    "check AWS_ENDPOINT_URL and that the store is up", "unreachable")
        return StoreError(f"{op} {where} failed: {type(e).__name__}: {_summary(e)}",
                          "check the store and the credentials", "other")

    # ---- operations ------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        import obstore

        try:
            return bytes(obstore.get(self._store, key).bytes())
        except Exception as e:
            raise self.error(e, key, "GET") from None

    def get_or_none(self, key: str) -> bytes | None:
        try:
            return self.get(key)
        except StoreError as e:
            if e.kind == "missing":
                return None
            raise

    def head(self, key: str) -> int | None:
        """The object's size, or None when it does not exist."""
        import obstore

        try:
            return int(obstore.head(self._store, key)["size"])
        except Exception as e:
            err = self.error(e, key, "HEAD")
            if err.kind == "missing":
                return None
            raise err from None

    def get_range(self, key: str, start: int, end: int) -> Buffer:
        import obstore

        try:
            return obstore.get_range(self._store, key, start=start, end=end)
        except Exception as e:
            raise self.error(e, key, "GET (range)") from None

    def put(self, key: str, data: bytes | Path, *, create: bool = False) -> bool:
        """Write an object atomically; with `create`, only when it does not exist yet
        (returns False then). Files are uploaded in parts."""
        import obstore
        import obstore.exceptions as x

        try:
            obstore.put(self._store, key, data, mode="create" if create else "overwrite",
                        max_concurrency=CONCURRENCY)
        except (x.AlreadyExistsError, FileExistsError, x.PreconditionError):
            if create:
                return False
            raise
        except Exception as e:
            raise self.error(e, key, "PUT") from None
        return True

    def delete(self, key: str) -> None:
        import obstore

        try:
            obstore.delete(self._store, key)
        except Exception as e:
            raise self.error(e, key, "DELETE") from None

    def list(self, prefix: str) -> list[tuple[str, int]]:
        import obstore

        try:
            return [(str(o["path"]), int(o["size"]))
                    for batch in obstore.list(self._store, prefix=prefix) for o in batch]
        except Exception as e:
            raise self.error(e, prefix, "LIST") from None

    def children(self, prefix: str) -> list[str]:
        """The names one level below `prefix` (directories / common prefixes)."""
        import obstore

        try:
            res = obstore.list_with_delimiter(self._store, prefix=prefix or None)
        except Exception as e:
            raise self.error(e, prefix, "LIST") from None
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in res["common_prefixes"]]

    # ---- parallel ranged reads -------------------------------------------------------

    def read_parts(self, key: str, size: int, sink: Callable[[int, Buffer], None],
                   part: int = PART_BYTES, concurrency: int = CONCURRENCY) -> float:
        """Read `key` (of `size` bytes) as ranged GETs, `concurrency` at once; `sink(offset,
        data)` is called from a worker thread as each part lands. Returns the seconds taken.

        The first failure cancels the reads not yet started and is raised as a StoreError;
        a read that does not finish within the deadline is reported as unreachable."""
        t0 = time.perf_counter()
        starts = list(range(0, size, part))

        def one(start: int) -> None:
            end = min(size, start + part)
            data = self.get_range(key, start, end)
            if len(memoryview(data)) != end - start:
                raise StoreError(f"{self.url(key)}: a ranged read returned "
                                 f"{len(memoryview(data))} bytes for {end - start} "
                                 f"(the object is shorter than the manifest says)",
                                 "push the engine again", "other")
            sink(start, data)

        pool = ThreadPoolExecutor(max(1, min(concurrency, len(starts))),
                                  thread_name_prefix="store-read")
        try:
            pending = {pool.submit(one, s) for s in starts}
            while pending:
                # Each request has its own timeout and retries; this catches a read that
                # makes no progress at all (no part lands) for twice the deadline.
                done, pending = wait(pending, timeout=self.deadline * 2,
                                     return_when=FIRST_COMPLETED)
                if not done:
                    raise StoreError(f"GET {self.url(key)}: endpoint {endpoint()} unreachable "
                                     f"(no data for {self.deadline * 2:.0f} s)",
                                     "check AWS_ENDPOINT_URL and that the store is up",
                                     "unreachable")
                for f in done:
                    exc = f.exception()
                    if exc is not None:
                        raise self.error(exc, key, "GET")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return time.perf_counter() - t0


def read_into_hashed(store: ObjectStore, key: str, view: memoryview) -> tuple[str, float]:
    """Fill `view` (the object's size) with the object, as parallel ranged GETs; a second
    thread hashes each part as soon as every part before it is in, so verification costs
    no second pass. Returns the sha256 and the seconds taken. No torch: `pipeline pull`
    reads into a bytearray, the loader into a (pinned) tensor's memory."""
    size = len(view)
    h = hashlib.sha256()
    landed: dict[int, int] = {}  # offset -> length of the parts in, not hashed yet
    cond = threading.Condition()
    failed: list[BaseException] = []

    def sink(offset: int, data: Buffer) -> None:
        part = memoryview(data).cast("B")
        view[offset : offset + len(part)] = part
        with cond:
            landed[offset] = len(part)
            cond.notify()

    def hasher() -> None:
        pos = 0
        while pos < size:
            with cond:
                while pos not in landed and not failed:
                    cond.wait()
                if failed:
                    return
                n = landed.pop(pos)
            h.update(view[pos : pos + n])  # releases the GIL
            pos += n

    t0 = time.perf_counter()
    thread = threading.Thread(target=hasher, name="store-hash", daemon=True)
    thread.start()
    try:
        store.read_parts(key, size, sink)
    except BaseException as e:
        with cond:
            failed.append(e)
            cond.notify()
        raise
    thread.join()
    return h.hexdigest(), time.perf_counter() - t0
