"""`serve launch`: the command line and its typed, validated configuration."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from contract.speculative import Speculative
from runtime.env import API_KEY, THREADS, count

API_KEY_ENV = API_KEY.name
EXIT_DRAIN_CUT = 3  # the drain's deadline cut requests off (0: every request completed)
CPU_KV_FRACTION = 0.05
GPU_KV_FRACTION = 0.9
# Prompt tokens a step may compute while other requests decode, on a CPU (see
# runtime/core/scheduler_config.py): a 128-token chunk of the 135M demo costs about 0.2 s on 2
# cores, 512 about 1 s. GPUs run 2048-token steps in tens of milliseconds: no cap there.
CPU_PREFILL_WHILE_DECODING = 128
CPU_PREFILL_WHILE_WAITING = 128  # a 128-token step: about 0.25 s on 2 cores (135M demo)
TOOL_PARSERS = ("generic", "hermes", "llama3_json", "mistral")  # serve/api/tools.py FORMATS


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    # An engine directory, or STORE/MODEL@TAG | STORE/MODEL/ENGINE_ID (runtime/store/source.py)
    engine: str
    host: str = "127.0.0.1"
    port: int = 8000
    kv_cache_fraction: float | None = None  # None: 0.9 on a GPU, 0.05 on a CPU
    kv_cache_tokens: int | None = None
    max_queue: int = 256
    # None: CPU_PREFILL_WHILE_DECODING on a CPU, no cap on a GPU; 0: no cap
    max_prefill_tokens_while_decoding: int | None = None
    # None: CPU_PREFILL_WHILE_WAITING on a CPU, no cap on a GPU; 0: no cap
    max_prefill_tokens_while_waiting: int | None = None
    # Speculative decoding: None, the engine's (its manifest); "off"; "ngram[:K]";
    # "draft:ENGINE[:K]" (a TP=1 engine of the same tokenizer, run on rank 0)
    speculative: str | None = None
    warmup: str = "auto"
    drain_timeout: float = 30.0
    log_level: str = "info"
    run_dir: Path | None = None
    api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = 1 << 20
    max_connections: int = 1024
    header_timeout: float = 10.0
    # Structured output (runtime/core/grammar.py's GrammarConfig): a request waits this long for
    # its grammar to compile, else 400; compiles run on this many threads; compiled
    # grammars are kept up to this many MiB.
    grammar_compile_timeout: float = 5.0
    grammar_compile_workers: int = 2
    grammar_cache_mib: int = 256
    # Chat output split into reasoning_content and content (serve/api/reasoning.py's formats)
    reasoning_parser: str | None = None
    tool_parser: str | None = None  # None: detected from the chat template (serve/api/tools.py)
    chat_template: Path | None = None  # a Jinja file that replaces the engine's chat template
    engine_cache: Path | None = None  # None: engines from a store are read, not cached
    store_deadline: float = 30.0
    mpirun: str | None = None  # the launcher `serve launch` starts (else runtime/dist/mpi.py picks)
    comm_iface: str | None = None  # the ranks' interface (else GLOO/NCCL_SOCKET_IFNAME, else auto)
    hosts: str | None = None  # mpirun --host (several hosts), when `serve launch` starts mpirun
    hostfile: Path | None = None  # mpirun --hostfile
    mpirun_args: tuple[str, ...] = ()  # more of mpirun's own arguments, passed through

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", str(self.engine))
        if not self.store_deadline > 0:
            raise ValueError(f"--store-deadline must be positive, got {self.store_deadline}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.kv_cache_fraction is not None and self.kv_cache_tokens is not None:
            raise ValueError("give either --kv-cache-fraction or --kv-cache-tokens, not both")
        if self.kv_cache_fraction is not None and not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"--kv-cache-fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError(f"--kv-cache-tokens must be positive, got {self.kv_cache_tokens}")
        if self.max_queue < 1:
            raise ValueError(f"--max-queue must be at least 1, got {self.max_queue}")
        for flag, cap in (("decoding", self.max_prefill_tokens_while_decoding),
                          ("waiting", self.max_prefill_tokens_while_waiting)):
            if cap is not None and cap < 0:
                raise ValueError(f"--max-prefill-tokens-while-{flag} must be >= 0 (0: no cap), "
                                 f"got {cap}")
        if self.speculative is not None:
            try:
                spec = Speculative.parse(self.speculative)
            except ValueError as e:
                raise ValueError(f"--speculative: {e}") from None
            if spec is not None and spec.method == "draft":
                check_draft_dir(spec)
        count(THREADS)  # a bad AOTLLM_THREADS fails here, before any rank starts
        if self.warmup not in ("auto", "full", "none"):
            raise ValueError(f"--warmup must be auto, full or none, got {self.warmup!r}")
        if self.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError(f"--api-key (or {API_KEY_ENV}) must not be empty")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, got {self.max_connections}")
        if not self.header_timeout > 0:
            raise ValueError(f"--header-timeout must be positive, got {self.header_timeout}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError("--grammar-compile-timeout must be positive, got "
                             f"{self.grammar_compile_timeout}")
        if self.grammar_compile_workers < 1:
            raise ValueError("--grammar-compile-workers must be at least 1, got "
                             f"{self.grammar_compile_workers}")
        if self.grammar_cache_mib < 0:
            raise ValueError(f"--grammar-cache-mib must be >= 0, got {self.grammar_cache_mib}")
        if self.reasoning_parser is not None:
            from serve.api.reasoning import reasoning_format

            reasoning_format(self.reasoning_parser)  # ValueError naming the known ones
        if self.tool_parser is not None and self.tool_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-parser must be one of {', '.join(TOOL_PARSERS)}, got "
                             f"{self.tool_parser!r}")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ValueError(f"--chat-template {self.chat_template}: no such file")
        if self.hosts is not None and self.hostfile is not None:
            raise ValueError("give either --hosts or --hostfile, not both")
        if self.comm_iface is not None and not self.comm_iface.strip():
            raise ValueError("--comm-iface must name an interface")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError(f"--log-level must be debug, info, warning or error, got {self.log_level!r}")


def check_draft_dir(spec: Speculative) -> None:
    """What can be said of a draft engine before any rank starts: it is an engine directory
    of one rank and a torch backend (its host, vocabulary and tokenizer against the served
    engine's are checked at the compatible gate, where the engine's manifest is read)."""
    from runtime.executors.draft import DRAFT_BACKENDS, DraftEngineError, open_draft

    try:
        path, m, _ = open_draft(spec)
    except DraftEngineError as e:
        raise ValueError(f"--speculative: {e}") from None
    if m.tp != 1:
        raise ValueError(f"--speculative: the draft engine {path} is TP={m.tp}; a draft runs "
                         "on rank 0 alone; rebuild it with `pipeline build --tp 1`")
    if m.backend not in DRAFT_BACKENDS:
        raise ValueError(f"--speculative: the draft engine {path} is a {m.backend} engine; "
                         "rebuild it with --backend aoti or eager")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve launch",
        description="Serve a built engine: run under `mpirun -n TP`, one rank per engine rank.",
    )
    p.add_argument("--engine", required=True,
                   help="engine directory (pipeline build prints it), or an engine in a store: "
                   "STORE/MODEL@TAG or STORE/MODEL/ENGINE_ID, STORE being s3://BUCKET/PREFIX "
                   "(endpoint and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
                   "AWS_SECRET_ACCESS_KEY, AWS_REGION) or a store directory")
    p.add_argument("--engine-cache", default=None,
                   help="local cache of engines read from S3, keyed by engine id and verified "
                   "by hash (default: $AOT_LLM_CACHE/engines or ~/.cache/aot-llm/engines, as "
                   "`pipeline pull`); 'none' reads every start from the store")
    p.add_argument("--store-deadline", type=float, default=30.0,
                   help="seconds a store request may take, retries included, before the start "
                   "fails naming the object (default 30)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000; 0 picks a free one)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument(
        "--kv-cache-fraction", type=float, default=None,
        help=f"fraction of the memory left after weights for the KV cache (default {GPU_KV_FRACTION} "
        f"on a GPU; {CPU_KV_FRACTION} of available host memory on a CPU, whose memory is shared "
        "with everything else); never more than the build profile can use",
    )
    kv.add_argument("--kv-cache-tokens", type=int, default=None, help="KV cache size in tokens")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests admitted at once before 429 (default 256); a completions "
                   "batch of more prompts than this is a 400")
    p.add_argument("--max-prefill-tokens-while-decoding", type=int, default=None, metavar="N",
                   help="prompt tokens one step may compute while other requests decode, so "
                   "that a long prompt stalls their streams for a short chunk at a time "
                   f"(default {CPU_PREFILL_WHILE_DECODING} on a CPU, no cap on a GPU; 0: no "
                   "cap; the aoti and eager backends; TensorRT-LLM schedules by itself)")
    p.add_argument("--max-prefill-tokens-while-waiting", type=int, default=None, metavar="N",
                   help="prompt tokens running prompts may compute in a step that admits a "
                   "waiting request, so that a request arriving during a long prefill gets its "
                   "first token one short step later, not when the long prompt's chunk ends "
                   f"(default {CPU_PREFILL_WHILE_WAITING} on a CPU, no cap on a GPU; 0: no cap; "
                   "the aoti and eager backends)")
    p.add_argument("--speculative", default=None, metavar="off|ngram[:K]|draft:ENGINE[:K]",
                   help="speculative decoding: off; ngram (prompt lookup); or draft:ENGINE, "
                   "another engine of the same tokenizer (a TP=1 aoti or eager engine built for "
                   "this host, e.g. this model's --quant int4_wo build) run on rank 0, its KV "
                   "cache sized with the engine's and its files verified like the engine's; "
                   "K drafted tokens verified per step (default 4); lossless for every request "
                   "kind (greedy outputs unchanged, sampled ones the same distribution) "
                   "(default: what the engine was built with, `pipeline build --speculative`; "
                   "the aoti and eager backends)")
    p.add_argument("--warmup", choices=("auto", "full", "none"), default="auto",
                   help="auto (default): on a GPU the build profile's shapes, largest first; on "
                   "a CPU the golden check's two steps (prefill, then decode at the largest "
                   "batch) are the warmup, a compiled CPU step having no per-shape state; "
                   "full: the profile's shapes on any device; none: the golden check alone, "
                   "one step a token as the build ran it (it runs in every case)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds running requests may take to finish (default 30)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}; "
                   "prefer the variable: a flag is visible to every user in the process list)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body accepted, else 413 (default 1 MiB)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open HTTP connections at once; more are closed at accept (default 1024)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a new connection has to send its request header (default 10)")
    p.add_argument("--grammar-compile-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="seconds a structured-output request waits for its grammar to compile, "
                   "else 400 (default 5); the compile runs on and is cached")
    p.add_argument("--grammar-compile-workers", type=int, default=2, metavar="N",
                   help="threads that compile grammars; more compiles wait (default 2)")
    p.add_argument("--grammar-cache-mib", type=int, default=256, metavar="MIB",
                   help="compiled grammars kept, least recently used dropped first "
                   "(default 256 MiB; 0 keeps none)")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split a thinking model's chat output into reasoning_content (the "
                        "thinking) and content (the answer): deepseek_r1, qwen3 (<think>...</think>) "
                        "or mistral ([THINK]...[/THINK]); default: no split")
    p.add_argument("--tool-parser", default=None, choices=TOOL_PARSERS,
                   help="the chat tool-call format: hermes (<tool_call>), llama3_json, mistral "
                   "([TOOL_CALLS]) or generic (tools in a system message, JSON output under a "
                   "grammar); default: from the chat template's markers, generic when it "
                   "renders no tools")
    p.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                   help="a Jinja chat template that replaces the engine's (as vLLM's flag)")
    p.add_argument("--mpirun", default=None,
                   help="the mpirun `serve launch` starts when run on its own (default: "
                   "$AOTLLM_MPIRUN, else the mpirun of the MPI library mpi4py loads, else the "
                   "one beside this Python); it must belong to the MPI library TensorRT-LLM "
                   "loads (Open MPI flags)")
    multi = p.add_argument_group(
        "several hosts", "`serve launch` on its own passes these to the mpirun it starts; under "
        "your own mpirun give mpirun's --host/--hostfile to it instead")
    multi.add_argument("--hosts", default=None, metavar="HOST:SLOTS,...",
                       help="mpirun --host: the hosts and ranks per host, rank 0 on the first "
                       "(this host, which serves HTTP), e.g. node-a:1,node-b:1")
    multi.add_argument("--hostfile", type=Path, default=None,
                       help="mpirun --hostfile (one `HOST slots=N` a line, this host first)")
    multi.add_argument("--mpirun-arg", action="append", default=[], dest="mpirun_args",
                       metavar="ARG", help="one more argument for mpirun, passed as is "
                       "(repeat it: --mpirun-arg=--prtemca --mpirun-arg=plm_ssh_agent ...)")
    multi.add_argument("--comm-iface", default=None, metavar="IFACE[,IFACE]",
                       help="the interface the ranks' control plane, rendezvous store and gloo "
                       "bind (default: $GLOO_SOCKET_IFNAME, else $NCCL_SOCKET_IFNAME, else "
                       "chosen from the route to the other hosts; loopback on one host)")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="write rank{N}.pid and, at exit, rank{N}.exit (exit code) here")
    return p


def parse(argv: list[str]) -> LaunchConfig:
    ns = parser().parse_args(argv)
    if ns.engine_cache is None:
        from runtime.store.cache import default_cache

        cache: Path | None = default_cache()
    else:
        cache = None if ns.engine_cache.lower() == "none" else Path(ns.engine_cache)
    return LaunchConfig(
        engine=ns.engine, host=ns.host, port=ns.port, kv_cache_fraction=ns.kv_cache_fraction,
        kv_cache_tokens=ns.kv_cache_tokens, max_queue=ns.max_queue, warmup=ns.warmup,
        max_prefill_tokens_while_decoding=ns.max_prefill_tokens_while_decoding,
        max_prefill_tokens_while_waiting=ns.max_prefill_tokens_while_waiting,
        speculative=ns.speculative,
        drain_timeout=ns.drain_timeout, log_level=ns.log_level, run_dir=ns.run_dir,
        api_key=ns.api_key if ns.api_key is not None else API_KEY.raw(),
        max_body_bytes=ns.max_body_bytes, max_connections=ns.max_connections,
        header_timeout=ns.header_timeout, engine_cache=cache, store_deadline=ns.store_deadline,
        grammar_compile_timeout=ns.grammar_compile_timeout,
        grammar_compile_workers=ns.grammar_compile_workers,
        grammar_cache_mib=ns.grammar_cache_mib, reasoning_parser=ns.reasoning_parser,
        tool_parser=ns.tool_parser, chat_template=ns.chat_template,
        mpirun=ns.mpirun, comm_iface=ns.comm_iface,
        hosts=ns.hosts, hostfile=ns.hostfile, mpirun_args=tuple(ns.mpirun_args),
    )
