"""`pipeline build | verify | inspect | list | push | pull`: the build stage's command line.

Every failure the user can act on is one line on stderr ("error: cause — remedy") and a
non-zero exit (2 for bad input, 1 for the environment); a traceback appears only for a genuine
bug, with --debug. SIGTERM and SIGHUP stop a command as Ctrl-C does: the build's staging
directory is removed on the way out, and the exit status is 128 + the signal number.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from contract.errors import EXIT_BAD_INPUT, EXIT_FAILURE, BuildError
from contract.profile import BACKENDS, DTYPES, BuildProfile
from contract.quant import ALL_SCHEMES, INT4_GROUP_SIZES, SCHEMES
from contract.speculative import DEFAULT_NUM_TOKENS, Speculative
from pipeline.config import BuildConfig
from pipeline.progress import Progress, format_bytes

_DEFAULTS = BuildProfile()


class _Parser(argparse.ArgumentParser):
    """argparse prints usage plus a message; we keep the one-line error contract instead."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"error: {message} — see `{self.prog} --help`\n")
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pipeline", description="Build, verify and inspect AOT LLM engines.")
    p.add_argument("--debug", action="store_true", help="show a traceback for internal errors")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    debug = _Parser(add_help=False)
    debug.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )

    b = sub.add_parser("build", parents=[debug], help="build an engine from a checkpoint")
    b.add_argument(
        "model", metavar="MODEL", help="checkpoint dir, hf://org/name@revision, or a .gguf file"
    )
    b.add_argument("--tp", type=int, required=True, help="tensor-parallel size (number of ranks)")
    b.add_argument("--backend", choices=BACKENDS, default="aoti", help="default: %(default)s")
    b.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="default: %(default)s")
    b.add_argument("--target", default="auto", help="auto | cpu | cuda | sm_XX (default: auto)")
    b.add_argument(
        "--max-batch-size",
        type=int,
        default=_DEFAULTS.max_batch_size,
        help="most sequences in one step (default: %(default)s)",
    )
    b.add_argument(
        "--max-num-tokens",
        type=int,
        default=_DEFAULTS.max_num_tokens,
        help="token budget of one step (default: %(default)s)",
    )
    b.add_argument(
        "--max-seq-len",
        type=int,
        default=_DEFAULTS.max_seq_len,
        help="prompt + generated tokens of one sequence (default: %(default)s)",
    )
    b.add_argument(
        "--tokens-per-block",
        type=int,
        default=_DEFAULTS.tokens_per_block,
        help="KV cache block size (default: %(default)s)",
    )
    b.add_argument(
        "--quant", choices=ALL_SCHEMES, default="none",
        help="weight-only quantization of the linear layers (TensorRT-LLM's --qformat names; "
        "fp8: --backend trtllm on sm_89+ only; default: %(default)s)",
    )
    b.add_argument(
        "--quant-group-size", type=int, choices=INT4_GROUP_SIZES, default=None,
        help="inputs sharing one scale (int4 default 128; int8 default: one per output channel)",
    )
    b.add_argument(
        "--quant-lm-head", choices=SCHEMES, default="none",
        help="quantize the LM head too (and the embedding when tied to it; default: %(default)s)",
    )
    b.add_argument(
        "--speculative", default="off", metavar="off|ngram[:K]|draft:ENGINE[:K]",
        help="speculative decoding the served engine runs by default (`serve launch "
        "--speculative` overrides it): ngram is prompt lookup; draft:ENGINE drafts with "
        "another engine of the same tokenizer (a TP=1 aoti or eager engine for this host, e.g. "
        "this model's --quant int4_wo build), checked now and recorded by path and engine id; "
        f"K drafted tokens verified per step (default {DEFAULT_NUM_TOKENS}); lossless for "
        "every request kind (default: %(default)s)",
    )
    b.add_argument("--store", default="engines", help="engine store directory (default: engines)")
    b.add_argument("--mpirun", default=None,
                   help="the mpirun of the golden run when --tp > 1 (default: $AOTLLM_MPIRUN, "
                   "else the mpirun of the MPI library mpi4py loads)")
    b.set_defaults(func=cmd_build)

    v = sub.add_parser("verify", parents=[debug], help="rehash every file of an engine")
    v.add_argument("engine_dir", metavar="ENGINE_DIR", type=Path)
    v.set_defaults(func=cmd_verify)

    i = sub.add_parser("inspect", parents=[debug], help="show an engine's manifest")
    i.add_argument("engine_dir", metavar="ENGINE_DIR", type=Path)
    i.add_argument("--json", action="store_true", help="print the manifest as JSON")
    i.set_defaults(func=cmd_inspect)

    ls = sub.add_parser("list", parents=[debug], help="list the engines in a store")
    ls.add_argument("--store", default="engines", help="a store directory or s3://BUCKET/PREFIX")
    ls.set_defaults(func=cmd_list)

    ps = sub.add_parser("push", parents=[debug],
                        help="upload an engine to a store (files first, the manifest last)")
    ps.add_argument("engine_dir", metavar="ENGINE_DIR", type=Path)
    ps.add_argument("store", metavar="STORE", help="s3://BUCKET[/PREFIX] or a directory")
    ps.add_argument("--tag", default=None, help="point this tag (e.g. prod) at the engine")
    ps.set_defaults(func=cmd_push)

    pl = sub.add_parser("pull", parents=[debug],
                        help="fetch an engine from a store into the local cache, verified")
    pl.add_argument("ref", metavar="REF", help="STORE/MODEL@TAG or STORE/MODEL/ENGINE_ID")
    pl.add_argument("--cache", type=Path, default=None,
                    help="local cache directory (default: $AOT_LLM_CACHE/engines or "
                    "~/.cache/aot-llm/engines; `serve launch --engine-cache` reads the same)")
    pl.set_defaults(func=cmd_pull)
    return p


def _table(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return [
        indent + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
        for r in rows
    ]


def cmd_build(args: argparse.Namespace) -> int:
    from pipeline.build import build_engine
    from runtime.dist.mpi import MPIRUN_ENV

    if args.mpirun:  # the golden run's launcher, and its children's
        os.environ[MPIRUN_ENV] = args.mpirun

    try:
        profile = BuildProfile(
            max_batch_size=args.max_batch_size,
            max_num_tokens=args.max_num_tokens,
            max_seq_len=args.max_seq_len,
            tokens_per_block=args.tokens_per_block,
        )
        cfg = BuildConfig(
            model=args.model,
            tp=args.tp,
            backend=args.backend,
            dtype=args.dtype,
            target=args.target,
            profile=profile,
            store=args.store,
            quant=args.quant,
            quant_group_size=args.quant_group_size,
            quant_lm_head=args.quant_lm_head,
            speculative=Speculative.parse(args.speculative),
        )
    except ValueError as e:
        raise BuildError(str(e), "see `pipeline build --help`") from e
    result = build_engine(cfg, _progress())
    m, hit = result.manifest, result.cache_hit
    lines = [
        f"engine    {result.engine_id}  ({'cache hit, nothing rebuilt' if hit else 'built'})",
        f"model     {m.model_name}  from {m.source.uri}"
        + (f" @ {m.source.revision}" if m.source.revision else ""),
        f"backend   {m.backend}  target {m.target}  tp {m.tp}  dtype {m.dtype}",
        f"quant     {m.quant.describe()}",
        f"weights   {m.weight_layout}",
        f"drafter   {m.speculative or 'off'}",
        "files",
        *_table(
            [[f.path, format_bytes(f.size)] for f in m.files]
            + [["total", format_bytes(m.total_size)]],
            "  ",
        ),
        "stages",
        *_table(
            [[name, f"{secs:.1f} s"] for name, secs in result.stages.items()]
            + [["total", f"{sum(result.stages.values()):.1f} s"]],
            "  ",
        ),
    ]
    print("\n".join(lines))
    print(result.engine_dir.resolve())  # the last line: scripts capture it
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from contract.manifest import check_engine_files, read_manifest

    manifest = read_manifest(args.engine_dir)
    with _progress().stage("verify", total=manifest.total_size, unit="B") as st:
        problems = check_engine_files(args.engine_dir, manifest, st.advance)
    for path, reason in problems:
        print(f"error: {path}: {reason} — the engine is damaged; rebuild it", file=sys.stderr)
    if problems:
        return EXIT_FAILURE
    size = format_bytes(manifest.total_size)
    print(f"ok: {len(manifest.files)} files ({size}) in {args.engine_dir} match the manifest")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from contract.manifest import read_manifest
    from pipeline.fidelity import describe as describe_fidelity

    m = read_manifest(args.engine_dir)
    if args.json:
        print(json.dumps(m.to_dict(), indent=2))
        return 0
    rows = [
        ["engine", m.engine_id],
        ["model", m.model_name],
        ["source", m.source.uri],
        ["revision", m.source.revision or "-"],
        ["digest", m.source.digest],
        ["backend", m.backend],
        ["target", str(m.target)],
        ["tp", str(m.tp)],
        ["dtype", m.dtype],
        ["quant", m.quant.describe()],
        ["weight layout", m.weight_layout],
        *[[k, str(v)] for k, v in m.profile.to_dict().items()],
        *[[k, v] for k, v in m.toolchain.items()],
        ["golden", ", ".join(f"{k}" for k in m.golden) or "-"],
        ["fidelity", describe_fidelity(m.fidelity)],
    ]
    print("\n".join(_table(rows)))
    print("files")
    print(
        "\n".join(
            _table(
                [
                    [
                        f.path,
                        "-" if f.rank is None else f"rank {f.rank}",
                        format_bytes(f.size),
                        f.sha256[:16],
                    ]
                    for f in m.files
                ],
                "  ",
            )
        )
    )
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from pipeline.remote import describe_push, push

    print(describe_push(push(args.engine_dir, args.store, args.tag, _progress())))
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from pipeline.remote import describe_pull, pull
    from runtime.store.cache import default_cache

    result = pull(args.ref, args.cache or default_cache(), _progress())
    print(describe_pull(result))
    print(result.engine_dir.resolve())  # the last line: scripts capture it
    return 0


def _list_remote(store_uri: str) -> int:
    from contract.refs import TAGS_DIR, TagRecord, is_engine_id, manifest_key, tag_key
    from runtime.store.objstore import ObjectStore
    from runtime.store.source import manifest_from_text

    store = ObjectStore(store_uri)
    rows = [["MODEL", "ENGINE", "BACKEND", "TARGET", "TP", "DTYPE", "SIZE", "TAGS"]]
    for model in sorted(store.children("")):
        names = store.children(model)
        tags: dict[str, list[str]] = {}
        if TAGS_DIR in names:
            for key, _ in store.list(f"{model}/{TAGS_DIR}/"):
                name = key.rsplit("/", 1)[-1]
                try:
                    rec = TagRecord.from_bytes(store.get(tag_key(model, name)))
                except ValueError:
                    continue
                tags.setdefault(rec.engine_id, []).append(name)
        for eid in sorted(n for n in names if is_engine_id(n)):
            raw = store.get_or_none(manifest_key(model, eid))
            if raw is None:
                continue  # files without a manifest: a push in progress, or one that died
            m = manifest_from_text(raw.decode(errors="replace"), store.url(manifest_key(model, eid)))
            rows.append([m.model_name, m.engine_id, m.backend, str(m.target), str(m.tp), m.dtype,
                         format_bytes(m.total_size), ",".join(sorted(tags.get(eid, []))) or "-"])
    if len(rows) == 1:
        print(f"no engines in {store_uri}")
        return 0
    print("\n".join(_table(rows)))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from contract.refs import is_remote
    from pipeline.store import EngineStore

    if is_remote(args.store):
        return _list_remote(args.store)
    records = EngineStore(args.store).list_engines()
    if not records:
        print(f"no engines in {args.store}")
        return 0
    rows = [["MODEL", "ENGINE", "BACKEND", "TARGET", "TP", "DTYPE", "SIZE", "PATH"]]
    for r in records:
        m = r.manifest
        if m is None:
            rows.append(
                [r.path.parent.name, r.path.name, "?", "?", "?", "?", "?", f"{r.path} ({r.error})"]
            )
        else:
            rows.append(
                [
                    m.model_name,
                    m.engine_id,
                    m.backend,
                    str(m.target),
                    str(m.tp),
                    m.dtype + (f"/{m.quant.scheme}" if m.quant.enabled else ""),
                    format_bytes(m.total_size),
                    str(r.path),
                ]
            )
    print("\n".join(_table(rows)))
    return 0


class _Terminated(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread so that every `finally` runs (the build's
    staging directory is removed) instead of the process vanishing mid-write."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# The signal that stopped this command. A handler's exception raised while a finalizer runs
# (tqdm's __del__, say) is swallowed by Python ("Exception ignored in ..."), and the build
# went on to finish and exit 0 after a SIGHUP (seen once in CI); each new stage checks this.
_received: list[int] = []


def _on_signal(signum: int, frame: object) -> NoReturn:
    for s in _HANDLED_SIGNALS:  # a second signal must not interrupt the cleanup it started
        signal.signal(s, signal.SIG_IGN)
    _received.append(signum)
    raise _Terminated(signum)


def _checkpoint() -> None:
    """Raise the stop signal again if its first exception was swallowed."""
    if _received:
        raise _Terminated(_received[0])


def _progress() -> Progress:
    return Progress(sys.stderr, checkpoint=_checkpoint)


_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    installed = []
    if threading.current_thread() is threading.main_thread():
        for s in _HANDLED_SIGNALS:
            if signal.getsignal(s) is signal.SIG_DFL:  # keep nohup's ignored SIGHUP ignored
                signal.signal(s, _on_signal)
                installed.append(s)
    try:
        return _run(args)
    finally:
        for s in installed:
            signal.signal(s, signal.SIG_DFL)


def _run(args: argparse.Namespace) -> int:
    try:
        return args.func(args)
    except _Terminated as e:
        name = signal.Signals(e.signum).name
        print(
            f"error: stopped by {name} — nothing was left half-written; run the command again",
            file=sys.stderr,
        )
        return 128 + e.signum
    except BuildError as e:
        if args.debug:  # the library error behind the message, for whoever reports it
            traceback.print_exc()
        print(e, file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(
            "error: interrupted — nothing was left half-written; run the command again",
            file=sys.stderr,
        )
        return 130
    except BrokenPipeError:
        return EXIT_FAILURE
    except Exception as e:  # a bug of ours: still one line unless asked for the traceback
        if args.debug:
            traceback.print_exc()
        msg = " ".join(f"{e.__class__.__name__}: {e}".split())
        print(f"error: internal error: {msg} — rerun with --debug and report it", file=sys.stderr)
        return EXIT_FAILURE
