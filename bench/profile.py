"""Where one decode step's time goes, for a built engine (TP=1, or TP=2 under mpirun).

    python -m bench.profile --engine ENGINE_DIR [--batches 1 16] [--context 128] [--steps 32]
    mpirun -n 2 python -m bench.profile --engine TP2_ENGINE_DIR   (rank 0 reports)

Engine level: LLMEngine in this process over the engine's own runner (the compiled step
for aoti), each host-side stage timed (schedule, input preparation, the step function,
sampling) and the step's share of the decode floor (weight bytes per step over the
measured memory read bandwidth). Component level, on this rank's weights, run eagerly with
the step's shapes: the GEMMs, the attention (our kernel and the tensor path), and the
norms/rope/elementwise work; at TP > 1, one all-reduce. The compiled step fuses what the
eager components run separately, so the components bound the step rather than add up to it.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import RESULTS, loadavg, md_table
from bench.floors import memory_read_gbs
from contract.layout import KERNELS_LIB
from contract.manifest import read_manifest
from contract.profile import BuildProfile
from runtime import kernels
from runtime.core.scheduler import SchedulerConfig
from runtime.core.types import SamplingParams
from runtime.dist.comm import Comm, finish
from runtime.executors.loop import LLMEngine, worker_loop
from runtime.executors.torch import runner_from_engine
from runtime.models.attention import decode_attention
from runtime.models.parallel import WORLD_GROUP_NAME, TPContext
from runtime.models.rope import apply_rope, inv_frequencies
from runtime.store.files import EngineFiles
from runtime.store.floors import best_seconds


class Timers:
    """Wraps callables to add up their wall time under a name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
        return timed


def _best_ms(fn: Callable[[], object], repeats: int = 20) -> float:
    return best_seconds(fn, repeats) * 1e3


def scheduler_config(p: BuildProfile) -> SchedulerConfig:
    """A scheduler for the engine's whole profile: KV blocks for max_batch_size sequences of
    max_seq_len tokens (and the null block), no prefix cache: every prompt is computed."""
    blocks = p.max_batch_size * p.max_seq_len // p.tokens_per_block + 1
    return SchedulerConfig(p.max_batch_size, p.max_num_tokens, p.tokens_per_block, blocks,
                           p.max_seq_len, ())


def engine_level(engine: LLMEngine, batch: int, context: int, steps: int,
                 vocab: int) -> dict[str, float]:
    """Decode `steps` tokens for `batch` sequences of `context` prompt tokens, timed."""
    import runtime.executors.runner as runner_mod

    timers = Timers()
    sched, runner = engine.scheduler, engine.runner
    sched.schedule = timers.wrap("schedule", sched.schedule)  # type: ignore[method-assign]
    runner.step_fn = timers.wrap("step function", runner.step_fn)
    sampler = engine.sampler
    sampler.sample_seqs = timers.wrap("sample", sampler.sample_seqs)  # type: ignore[method-assign]
    orig_prepare = runner_mod.prepare_inputs
    runner_mod.prepare_inputs = timers.wrap("prepare inputs", orig_prepare)
    try:
        prompts = [[(7 * b + 13 * i) % vocab for i in range(context)] for b in range(batch)]
        # Prefills end in different steps (chunked by the token budget), so sequences finish
        # staggered by as many steps: every one must still be running in the timed window.
        stagger = -(-batch * context // engine.scheduler.config.max_num_tokens) + 1
        params = [SamplingParams(max_tokens=steps + 2 + stagger, temperature=0.0,
                                 ignore_eos=True)] * batch
        tokens = [0] * batch  # each sequence's tokens so far

        def count(i: int) -> Callable[[Any], None]:
            return lambda ev: tokens.__setitem__(i, tokens[i] + len(ev.token_ids))

        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"p{i}", p, sp, count(i))
        # Every prefill done and one decode step behind it: the window is pure decode. (A
        # total of 2 * batch tokens came sooner, from the first sequences' decodes while later
        # prompts were still in prefill: 32 steps at batch 16 then timed 66 ms a step where
        # pure decode takes 50.)
        while min(tokens) < 2:
            engine.step()
        timers.seconds.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        n = steps
        wall = time.perf_counter() - t0
        window = dict(timers.seconds)
        while engine.step() is not None:  # the rest, untimed
            pass
    finally:
        runner_mod.prepare_inputs = orig_prepare
    out = {"steps": n, "ms_per_step": wall / max(n, 1) * 1e3, "tok_s": batch * n / wall}
    out.update({f"{k} ms": v / max(n, 1) * 1e3 for k, v in window.items()})
    out["other host ms"] = out["ms_per_step"] - sum(v for k, v in out.items() if k.endswith(" ms"))
    return out


def components(weights: dict[str, torch.Tensor], cfg: Any, tp: int, batch: int,
               context: int, device_kv: tuple[torch.Tensor, torch.Tensor],
               panels: bool = False) -> dict[str, float]:
    """Eager timings of each kind of work in one decode step, on this rank's weights
    (`panels`: the engine stores its layer linears in panels, as its program reads them).
    The attention runs over one layer's cache for every layer, so its keys stay in cache:
    the engine, whose 30 layers' caches do not fit, measures up to 2x more at batch 16."""
    linears = [w for name, w in weights.items() if name.endswith("proj.weight")]
    if not linears:  # a quantized engine: its linears are qweight/scales; engine level only
        return {}
    dtype = linears[0].dtype
    head = weights.get("lm_head.weight", weights["embed_tokens.weight"])
    x = torch.randn(batch, cfg.hidden_size).to(dtype)
    out: dict[str, float] = {}

    def gemms() -> None:
        for w in linears:
            F.linear(torch.empty(batch, w.shape[1], dtype=dtype), w)
        F.linear(x, head)

    out["GEMMs (all layers + LM head), at::linear"] = _best_ms(gemms, 10)
    if kernels.available():  # what an aoti engine on a CPU runs

        def ours() -> None:
            for w in linears:
                torch.ops.aotllm.linear(torch.empty(batch, w.shape[1], dtype=dtype), w, None)
            torch.ops.aotllm.linear(x, head, None)

        out["GEMMs (all layers + LM head), aotllm::linear"] = _best_ms(ours, 10)
    if panels:  # the layer linears as this engine's program multiplies them

        def panel() -> None:
            for w in linears:
                torch.ops.aotllm.linear_panel(torch.empty(batch, w.shape[1], dtype=dtype), w, None)
            torch.ops.aotllm.linear(x, head, None)

        out["GEMMs (all layers + LM head), aotllm::linear_panel"] = _best_ms(panel, 10)
    k_cache, v_cache = device_kv
    hq = cfg.num_attention_heads // tp if cfg.num_attention_heads % tp == 0 else None
    hq = hq or k_cache.shape[2] * (cfg.num_attention_heads // cfg.num_key_value_heads)
    q = torch.randn(batch, hq, cfg.head_dim).to(dtype)
    bs = k_cache.shape[1]
    m = -(-context // bs)
    tables = torch.arange(1, batch * m + 1).view(batch, m) % (k_cache.shape[0] - 1) + 1
    ctx = torch.full((batch,), context)
    scale = cfg.head_dim**-0.5
    layers = cfg.num_hidden_layers
    out["attention, tensor path"] = layers * _best_ms(
        lambda: decode_attention(q, k_cache, v_cache, tables, ctx, scale))
    if kernels.available():
        out["attention, fused kernel"] = layers * _best_ms(
            lambda: torch.ops.aotllm.paged_decode_attention(q, k_cache, v_cache, tables, ctx,
                                                             scale))
    inv = inv_frequencies(cfg.rope, cfg.head_dim)
    pos = torch.full((batch,), context)
    norm_w = torch.ones(cfg.hidden_size, dtype=dtype)
    inter = linears[1].shape[0] if len(linears) > 1 else 2 * cfg.intermediate_size

    def elementwise() -> None:
        for _ in range(layers):
            for _ in range(2):  # input and post-attention RMSNorm, residual add
                xf = x.float()
                y = norm_w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
                _ = x + y
            apply_rope(q, q[:, : k_cache.shape[2]], pos, inv)
            gate, up = torch.empty(batch, inter, dtype=dtype).chunk(2, dim=-1)
            F.silu(gate) * up

    out["norms, rope, SwiGLU, residual (eager)"] = _best_ms(elementwise, 5)
    return out


def all_reduce_ms(comm: Comm, hidden: int, dtype: torch.dtype, batch: int,
                  ours: bool, n: int = 200) -> float:
    """Mean ms of one all-reduce of a [batch, hidden] activation, every rank in lockstep,
    through the transport the engine's program uses."""
    if comm.size == 1:
        return 0.0
    tp = TPContext(comm.rank, comm.size, use_kernels=ours)
    x = torch.randn(batch, hidden).to(dtype)
    for _ in range(10):
        tp.all_reduce(x)
    t = time.perf_counter()
    for _ in range(n):
        tp.all_reduce(x)
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--kernels", type=Path, default=None,
                    help="a kernels library to run instead of the engine's own (the A/B of a "
                    "kernel change on one engine; the ops must keep their schemas)")
    args = ap.parse_args()
    if args.kernels is not None:  # loaded first, the engine's own copy is then not loaded
        kernels.load(args.kernels)
    comm = Comm.from_mpi()
    m = read_manifest(args.engine)
    files = EngineFiles(args.engine, m)
    cores = len(__import__("os").sched_getaffinity(0))
    torch.set_num_threads(max(1, cores // comm.size))
    comm.init_process_group("gloo")
    p = m.profile
    # A sequence longer than the engine's context is refused by the scheduler, and the
    # window below would wait for its tokens for ever: say so instead.
    longest = args.context + args.steps + 3 - (-max(args.batches) * args.context // p.max_num_tokens)
    if longest > p.max_seq_len or max(args.batches) > p.max_batch_size:
        raise SystemExit(f"error: --context {args.context} + --steps {args.steps} needs "
                         f"{longest} tokens a sequence and --batches up to {max(args.batches)}; "
                         f"this engine holds {p.max_seq_len} tokens and {p.max_batch_size} "
                         "sequences: lower --steps or --context")
    sc = scheduler_config(p)
    tp = TPContext(comm.rank, comm.size)
    runner, cfg = runner_from_engine(args.engine, m.backend, m.dtype, tp, sc.num_blocks,
                                     p.tokens_per_block, p.max_num_tokens, files=files)
    transport = "gloo" if comm.size > 1 else "none"
    if comm.size > 1 and files.listed(KERNELS_LIB):
        slot = kernels.slot_bytes_for(p.max_num_tokens, cfg.hidden_size, cfg.vocab_size, m.tp)
        transport = kernels.attach_shared_memory(comm, WORLD_GROUP_NAME, slot)
    collective = {b: all_reduce_ms(comm, cfg.hidden_size, runner.kv_cache.dtype, b,
                                   files.listed(KERNELS_LIB)) for b in args.batches}
    if comm.rank != 0:
        for _ in args.batches:
            worker_loop(runner, comm)
        finish(0, comm)
    report: dict[str, Any] = {"engine": str(args.engine), "backend": m.backend, "tp": m.tp,
                              "dtype": m.dtype, "threads": torch.get_num_threads(),
                              "collectives": transport, "load": loadavg(), "batches": {}}
    read_gbs = memory_read_gbs(1 << 28, 3)["torch_sum"]
    weight_bytes = sum(f.size for f in m.files if f.rank == 0 and f.path.endswith(".safetensors"))
    emb = cfg.vocab_size // m.tp * cfg.hidden_size * torch.empty((), dtype=runner.kv_cache.dtype).element_size()
    floor_ms = (weight_bytes - emb * (0 if cfg.tie_word_embeddings else 1)) / (read_gbs * 1e9) * 1e3
    report.update(memory_read_gbs=read_gbs, decode_floor_ms_batch1=floor_ms)
    for b in args.batches:
        engine = LLMEngine(runner, sc, comm)
        eng = engine_level(engine, b, args.context, args.steps, cfg.vocab_size)
        engine.shutdown_workers()
        eng["% of decode floor"] = 100 * floor_ms / eng["ms_per_step"] if b == 1 else None
        kv = (runner.kv_cache[0, 0], runner.kv_cache[0, 1])
        comp = components(runner.keepalive.weights, cfg, m.tp, b, args.context, kv,
                           m.weight_layout == "panels16")
        if comm.size > 1:
            comp[f"all-reduces ({2 * cfg.num_hidden_layers + 1} a step)"] = (
                (2 * cfg.num_hidden_layers + 1) * collective[b])
        report["batches"][str(b)] = {"engine": eng, "components": comp}
    _print(report)
    out = args.out or RESULTS / time.strftime("%Y%m%d-%H%M%S") / "profile.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"written {out}")
    finish(0, comm)


def _print(report: dict[str, Any]) -> None:
    print(f"engine {report['engine']}  {report['backend']} TP={report['tp']} {report['dtype']}, "
          f"{report['threads']} thread(s)/rank, collectives: {report['collectives']}, "
          f"load {report['load']}")
    print(f"memory read {report['memory_read_gbs']:.1f} GB/s -> decode floor at batch 1 "
          f"{report['decode_floor_ms_batch1']:.2f} ms/step")
    for b, r in report["batches"].items():
        e = r["engine"]
        rows = [[k, f"{v:.3f}" if isinstance(v, float) else str(v)] for k, v in e.items()]
        rows += [[f"component: {k}", f"{v:.3f}"] for k, v in r["components"].items()]
        print(f"\nbatch {b}")
        print("\n".join(md_table(["", "ms per step (or value)"], rows)))


if __name__ == "__main__":
    main()
