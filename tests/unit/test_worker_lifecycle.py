"""A rank's serving process when its supervisor dies: at once during start-up, a drain after.

The worker runs in a child process (it leaves with os._exit); the test plays its supervisor,
holding the pipe whose EOF tells the worker its supervisor is gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serve.supervisor import PARENT_FD_ENV
from tests.conftest import REPO

CHILD = """
import sys, time
from pathlib import Path
from serve.lifecycle import Lifecycle
life = Lifecycle(Path(sys.argv[1]), rank=1)
life.drain.set()  # mpirun's SIGTERM, forwarded by the supervisor before mpirun killed it
if sys.argv[2] == "serving":
    life.serving.set()
print("ready", flush=True)
time.sleep(30)  # a long gate (a load), or a drain with requests still running
"""


@pytest.mark.parametrize("phase", ["start-up", "serving"])
def test_supervisor_death_ends_start_up_at_once_but_not_a_drain(phase: str, tmp_path: Path
                                                                 ) -> None:
    r, w = os.pipe()
    env = {**os.environ, PARENT_FD_ENV: str(r),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), phase], cwd=REPO,
                             env=env, pass_fds=[r], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    os.close(r)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        os.close(w)  # the supervisor is gone
        gone = time.monotonic()
        if phase == "start-up":
            assert child.wait(5) == 1
            assert time.monotonic() - gone < 2
            assert (tmp_path / "rank1.exit").read_text() == "1\n"
            log = (tmp_path / "rank1.log").read_text() if (tmp_path / "rank1.log").exists() \
                else ""
            err = child.stderr.read() if child.stderr else ""
            assert "supervisor is gone during start-up" in err + log
        else:
            with pytest.raises(subprocess.TimeoutExpired):
                child.wait(1.5)  # still draining
    finally:
        child.kill()
        child.wait(10)
