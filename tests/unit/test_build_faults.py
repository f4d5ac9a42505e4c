"""`pipeline build` under faults, with real subprocesses: two builds of one engine at once, a
build killed (SIGKILL, SIGTERM, SIGHUP) midway, a disk that fills up while it writes.

The promises: one engine in the store and both commands succeed; no partial engine is ever
listed or served; the next build (a cache hit too) removes what a killed one left; every
failure is one line "error: cause — remedy" with exit 2 for bad input, 1 for the environment.
Tiny eager float32 engines: a build is a few seconds, most of it the child's imports.
"""

from __future__ import annotations

import errno
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from contract.errors import EXIT_FAILURE, BuildError
from contract.manifest import check_engine_files, read_manifest
from contract.profile import BuildProfile
from pipeline import cli
from pipeline.build import build_engine, plan_build
from pipeline.config import BuildConfig
from pipeline.progress import format_bytes
from pipeline.store import EngineStore
from tests.conftest import REPO, make_tiny_checkpoint, subprocess_env
from tests.unit.test_store import _STAGE_AND_WAIT, _kill, _spawn, tmpfs  # noqa: F401

MODEL = "tiny"
BUILD_ARGS = ("--tp", "1", "--backend", "eager", "--dtype", "float32", "--max-seq-len", "64",
              "--max-num-tokens", "16", "--max-batch-size", "2")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / MODEL)


def _cfg(ckpt: Path, store: Path) -> BuildConfig:
    """BUILD_ARGS as a BuildConfig, for the in-process builds."""
    profile = BuildProfile(max_batch_size=2, max_num_tokens=16, max_seq_len=64)
    return BuildConfig(model=str(ckpt), tp=1, backend="eager", dtype="float32", profile=profile,
                       store=str(store))


def _default_signals() -> None:
    # As from a terminal, even when these tests run under nohup (SIGHUP ignored, inherited).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _start(ckpt: Path, store: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", "build", str(ckpt), *BUILD_ARGS, "--store", str(store)],
        cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_default_signals,
    )


def _wait_for(what: Callable[[], Path | None], proc: subprocess.Popen[str], timeout: float = 120
              ) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = what()
        if found is not None:
            return found
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the build ended ({proc.returncode}) before the point waited for:\n"
                        f"{out[-2000:]}\n{err[-2000:]}")
        time.sleep(0.002)
    pytest.fail("timed out waiting for the build")


def _staged(store: Path, besides: Path | None = None) -> Callable[[], Path | None]:
    """A staging directory the converter has written a shard into: the build is midway."""

    def find() -> Path | None:
        for d in (store / MODEL).glob(".tmp-*"):
            if d != besides and (d / "rank0.safetensors").exists():
                return d
        return None

    return find


def _staging_dirs(store: Path) -> list[Path]:
    return sorted((store / MODEL).glob(".tmp-*"))


def _one_line_error(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and " — " in last, stderr
    return last


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_two_builds_of_one_engine_at_once(ckpt: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Both builds get past the cache check and build (the first is paused midway until the
    second is too), race to the rename, and both succeed with the one engine in the store."""
    store = tmp_path / "store"
    a = _start(ckpt, store)
    tmp_a = _wait_for(_staged(store), a)
    a.send_signal(signal.SIGSTOP)
    try:
        b = _start(ckpt, store)
        tmp_b = _wait_for(_staged(store, besides=tmp_a), b)
        assert tmp_a.is_dir()  # b's cleaning left the paused (live, locked) build alone
    finally:
        a.send_signal(signal.SIGCONT)
    out_a, err_a = a.communicate(timeout=300)
    out_b, err_b = b.communicate(timeout=300)
    assert a.returncode == 0, err_a[-3000:]
    assert b.returncode == 0, err_b[-3000:]
    engine = Path(out_a.strip().splitlines()[-1])
    assert out_b.strip().splitlines()[-1] == str(engine)
    assert "(built)" in out_a and "(built)" in out_b  # neither was a cache hit: a real race
    assert not tmp_a.exists() and not tmp_b.exists()
    assert sorted(p.name for p in (store / MODEL).iterdir()) == [engine.name]
    manifest = read_manifest(engine)
    assert check_engine_files(engine, manifest) == []
    for out in (out_a, out_b):  # both report the engine that is in the store
        for f in manifest.files:
            assert any(line.split() == [f.path, *format_bytes(f.size).split()]
                       for line in out.splitlines()), (f.path, out)
    assert [r.path for r in EngineStore(store).list_engines()] == [engine]
    rc, out, _ = _main(["list", "--store", str(store)], capsys)
    assert rc == 0 and len(out.strip().splitlines()) == 2 and str(engine) in out


def test_a_killed_build_is_never_listed_or_served(ckpt: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    proc = _start(ckpt, store)
    tmp = _wait_for(_staged(store), proc)
    _kill(proc)
    assert proc.returncode == -signal.SIGKILL
    assert _staging_dirs(store) == [tmp]  # SIGKILL leaves it; no one may read it
    assert EngineStore(store).list_engines() == []
    rc, out, _ = _main(["list", "--store", str(store)], capsys)
    assert (rc, out.strip()) == (0, f"no engines in {store}")
    with pytest.raises(BuildError, match="staging directory of a build that is running or died"):
        read_manifest(tmp)  # what the server's resolve gate reads
    for cmd in ("verify", "inspect"):
        rc, out, err = _main([cmd, str(tmp)], capsys)
        assert rc == 2 and out == "" and "staging directory" in _one_line_error(err)
    # The next build removes the leftover and publishes the engine.
    rc, out, err = _main(["build", str(ckpt), *BUILD_ARGS, "--store", str(store)], capsys)
    assert rc == 0, err
    engine = Path(out.strip().splitlines()[-1])
    assert not tmp.exists() and _staging_dirs(store) == []
    assert sorted(p.name for p in (store / MODEL).iterdir()) == [engine.name]
    assert check_engine_files(engine, read_manifest(engine)) == []


def test_a_stop_signal_swallowed_by_a_finalizer_still_stops_the_next_stage(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The signal handler raises in whatever the main thread runs; inside a finalizer
    (tqdm's __del__ in the CI run that found this) Python swallows the exception, and the
    build went on to finish and exit 0. The next stage must raise it again."""
    swallowed: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: swallowed.append(u.exc_value))
    monkeypatch.setattr(cli, "_received", [])
    saved = {s: signal.getsignal(s) for s in cli._HANDLED_SIGNALS}

    class Finalized:
        def __del__(self) -> None:
            cli._on_signal(signal.SIGHUP, None)

    try:
        obj = Finalized()
        del obj  # the handler's exception is raised, and swallowed, in __del__
        assert [type(e) for e in swallowed] == [cli._Terminated]
        progress = cli._progress()
        with pytest.raises(cli._Terminated) as raised:
            progress.stage("copy tokenizer")
        assert raised.value.signum == signal.SIGHUP
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_terminated_build_cleans_up_after_itself(ckpt: Path, tmp_path: Path,
                                                   sig: signal.Signals) -> None:
    store = tmp_path / "store"
    proc = _start(ckpt, store)
    tmp = _wait_for(_staged(store), proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err[-2000:]
    assert _one_line_error(err) == (f"error: stopped by {sig.name} — nothing was left "
                                    "half-written; run the command again")
    assert not tmp.exists() and _staging_dirs(store) == []
    assert EngineStore(store).list_engines() == []


def test_a_cache_hit_cleans_what_killed_builds_left(ckpt: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    rc, out, err = _main(["build", str(ckpt), *BUILD_ARGS, "--store", str(store)], capsys)
    assert rc == 0, err
    engine = Path(out.strip().splitlines()[-1])
    # A build of another engine of this model (say another dtype) killed midway.
    helper, leftover = _spawn(_STAGE_AND_WAIT, str(store), MODEL, "fedcba9876543210")
    _kill(helper)
    assert Path(leftover).is_dir()
    rc, out, err = _main(["build", str(ckpt), *BUILD_ARGS, "--store", str(store)], capsys)
    assert rc == 0, err
    assert "(cache hit, nothing rebuilt)" in out and out.strip().splitlines()[-1] == str(engine)
    assert not Path(leftover).exists() and _staging_dirs(store) == []


def test_the_loser_of_a_race_reports_the_engine_in_the_store(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Builds need not be byte-identical (an aoti package may not be): the build that loses
    the rename must report the manifest of the engine that won, not its discarded copy."""
    real_commit = EngineStore.commit

    def twin_wins_first(self: EngineStore, tmp: Path, model: str, eid: str) -> Path:
        twin = self.engine_dir(model, eid)
        shutil.copytree(tmp, twin)
        data = json.loads((twin / "manifest.json").read_text())
        data["golden"]["twin"] = True
        (twin / "manifest.json").write_text(json.dumps(data))
        return real_commit(self, tmp, model, eid)

    monkeypatch.setattr(EngineStore, "commit", twin_wins_first)
    result = build_engine(_cfg(ckpt, tmp_path / "store"))
    assert not result.cache_hit
    assert result.manifest == read_manifest(result.engine_dir)
    assert result.manifest.golden.get("twin") is True
    assert _staging_dirs(tmp_path / "store") == []


def test_the_engines_place_taken_by_a_non_engine(ckpt: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    plan = plan_build(_cfg(ckpt, store))
    junk = store / MODEL / plan.engine_id
    junk.mkdir(parents=True)
    (junk / "rank0.safetensors").write_bytes(b"half a copy")
    rc, out, err = _main(["build", str(ckpt), *BUILD_ARGS, "--store", str(store)], capsys)
    assert rc == EXIT_FAILURE and out == ""
    assert _one_line_error(err) == (
        f"error: {junk} exists but is not a complete engine (it has no manifest.json) — remove "
        "that directory (engines are only ever written by pipeline build) and build again")
    assert _staging_dirs(store) == [] and EngineStore(store).list_engines() == []


# --- a real full disk (tmpfs) ---


def _fill(disk: Path) -> Path:
    filler = disk / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * (256 << 10))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def test_the_disk_fills_up_while_the_build_writes(ckpt: Path, tmp_path: Path, tmpfs,  # noqa: F811
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Enough space when the build checks; another writer fills the disk while it runs."""
    disk = tmpfs("24m")
    store = disk / "store"
    proc = _start(ckpt, store)
    tmp = _wait_for(_staged(store), proc)
    proc.send_signal(signal.SIGSTOP)
    try:
        filler = _fill(disk)
        assert shutil.disk_usage(disk).free < (64 << 10)
    finally:
        proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_FAILURE, err[-3000:]
    last = _one_line_error(err)
    assert last.startswith(f"error: disk full while writing the engine to {store}: it needs about")
    assert last.endswith("free some space or pass --store on a larger disk; nothing was left behind")
    assert not tmp.exists() and _staging_dirs(store) == []
    assert EngineStore(store).list_engines() == []
    filler.unlink()  # space again: the next build succeeds
    rc, _, err = _main(["build", str(ckpt), *BUILD_ARGS, "--store", str(store)], capsys)
    assert rc == 0, err
    assert _staging_dirs(store) == [] and len(EngineStore(store).list_engines()) == 1


def test_a_disk_too_small_is_refused_before_the_build(ckpt: Path, tmp_path: Path, tmpfs,  # noqa: F811
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    disk = tmpfs("2m")
    rc, out, err = _main(["build", str(ckpt), *BUILD_ARGS, "--store", str(disk / "s")], capsys)
    assert rc == EXIT_FAILURE and out == ""
    assert _one_line_error(err).startswith(f"error: not enough disk space in {disk / 's'}: the "
                                           "engine needs about")
    assert list((disk / "s").rglob(".tmp-*")) == [] and EngineStore(disk / "s").list_engines() == []


def test_a_cache_hit_from_a_read_only_store(ckpt: Path, tmp_path: Path, tmpfs,  # noqa: F811
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Cleaning leftovers on a cache hit must not cost the read-only store its cache hits."""
    disk = tmpfs("24m")
    store = disk / "store"
    rc, out, err = _main(["build", str(ckpt), *BUILD_ARGS, "--store", str(store)], capsys)
    assert rc == 0, err
    engine = Path(out.strip().splitlines()[-1])
    (store / MODEL / ".tmp-fedcba9876543210-1").mkdir()  # its build is gone; unlocked
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    rc, out, err = _main(["build", str(ckpt), *BUILD_ARGS, "--store", str(store)], capsys)
    assert rc == 0, err
    assert "(cache hit, nothing rebuilt)" in out and out.strip().splitlines()[-1] == str(engine)
    assert (store / MODEL / ".tmp-fedcba9876543210-1").is_dir()  # cannot be removed: kept


def test_the_cli_restores_signal_dispositions(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """Handlers are installed only for the command (and only over the default: `nohup` keeps
    its ignored SIGHUP), and put back afterwards."""
    seen: dict[str, object] = {}

    def fake_list(args: object) -> int:
        seen.update(term=signal.getsignal(signal.SIGTERM), hup=signal.getsignal(signal.SIGHUP))
        return 0

    monkeypatch.setattr(cli, "cmd_list", fake_list)
    old_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    old_term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        assert cli.main(["list", "--store", str(tmp_path)]) == 0
        assert seen["hup"] is signal.SIG_IGN and seen["term"] is cli._on_signal
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, old_hup)
        signal.signal(signal.SIGTERM, old_term)
