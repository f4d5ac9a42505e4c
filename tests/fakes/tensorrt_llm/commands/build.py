"""trtllm-build (tensorrt_llm/commands/build.py), the documented flags only (reference §1.2).

TP and PP come from the checkpoint's `mapping` (there is no --tp_size). Under mpirun the
ranks are split across MPI processes; otherwise they are built one after another.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
from pathlib import Path

from .._fake import env, mpi
from .._fake.toy import ToyModel
from ..builder import BuildConfig, build
from ..llmapi.kv_cache_type import KVCacheType
from ..models import MODEL_MAP, PretrainedConfig
from ..plugin.plugin import PluginConfig

_PLUGIN_DTYPE_CHOICES = [
    "auto",
    "float16",
    "float32",
    "bfloat16",
    "int32",
    "fp8",
    "nvfp4",
    "disable",
]
_BOOL_PLUGINS = (
    "context_fmha",
    "remove_input_padding",
    "use_paged_context_fmha",
    "multiple_profiles",
    "reduce_fusion",
    "use_fused_mlp",
)
_PRECISION_PLUGINS = ("gemm_plugin", "gpt_attention_plugin", "nccl_plugin")


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    d = BuildConfig()
    p = argparse.ArgumentParser(prog="trtllm-build")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint_dir")
    src.add_argument("--model_config", help="checkpoint config.json; builds with dummy weights")
    p.add_argument("--output_dir", default="engine_outputs")
    p.add_argument("--max_batch_size", type=int, default=d.max_batch_size)
    p.add_argument("--max_input_len", type=int, default=d.max_input_len)
    p.add_argument("--max_beam_width", type=int, default=d.max_beam_width)
    p.add_argument("--max_num_tokens", type=int, default=d.max_num_tokens)
    p.add_argument("--max_seq_len", "--max_decoder_seq_len", dest="max_seq_len", type=int)
    p.add_argument("--opt_num_tokens", type=int)
    p.add_argument("--kv_cache_type", choices=["continuous", "paged", "disabled"])
    p.add_argument("--paged_kv_cache", choices=["enable", "disable"])
    p.add_argument("--workers", type=int, default=1)
    for name in _PRECISION_PLUGINS:
        p.add_argument(
            f"--{name}",
            choices=_PLUGIN_DTYPE_CHOICES,
            default=_flag(PluginConfig.model_fields[name].default),
        )
    for name in _BOOL_PLUGINS:
        default = "enable" if PluginConfig.model_fields[name].default else "disable"
        p.add_argument(f"--{name}", choices=["enable", "disable"], default=default)
    p.add_argument(
        "--tokens_per_block",
        type=int,
        default=PluginConfig.model_fields["tokens_per_block"].default,
    )
    p.add_argument("--strip_plan", action="store_true")
    p.add_argument("--weight_streaming", action="store_true")
    p.add_argument("--fast_build", action="store_true")
    p.add_argument("--input_timing_cache")
    p.add_argument("--output_timing_cache", default="model.cache")
    p.add_argument("--log_level", default="info")
    p.add_argument("--dry_run", action="store_true")
    return p.parse_args(argv)


def _flag(default: str | None) -> str:
    return "disable" if default is None else default


def build_config_from_args(args: argparse.Namespace) -> BuildConfig:
    kv_type = args.kv_cache_type
    if args.paged_kv_cache is not None:
        env.log("WARNING", "--paged_kv_cache is deprecated, use --kv_cache_type instead")
        kv_type = kv_type or ("paged" if args.paged_kv_cache == "enable" else "continuous")
    plugin = PluginConfig(
        **{n: getattr(args, n) for n in _PRECISION_PLUGINS},
        **{n: getattr(args, n) == "enable" for n in _BOOL_PLUGINS},
        tokens_per_block=args.tokens_per_block,
    )
    return BuildConfig(
        max_input_len=args.max_input_len,
        max_seq_len=args.max_seq_len,
        max_batch_size=args.max_batch_size,
        max_beam_width=args.max_beam_width,
        max_num_tokens=args.max_num_tokens,
        opt_num_tokens=args.opt_num_tokens,
        kv_cache_type=None if kv_type is None else KVCacheType(kv_type),
        plugin_config=plugin,
        input_timing_cache=args.input_timing_cache,
        output_timing_cache=args.output_timing_cache,
        weight_streaming=args.weight_streaming,
        use_strip_plan=args.strip_plan,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    bc = build_config_from_args(args)
    if args.checkpoint_dir is not None:
        base = PretrainedConfig.from_checkpoint(args.checkpoint_dir)
    else:
        base = PretrainedConfig.from_json_file(args.model_config)
    w = mpi.world()
    for rank in range(base.mapping.world_size):
        if rank % w.size != w.rank:
            continue  # another MPI process builds this rank
        cfg = copy.deepcopy(base)
        cfg.set_rank(rank)
        model_cls = MODEL_MAP[cfg.architecture]
        if args.checkpoint_dir is not None:
            model = model_cls.from_checkpoint(args.checkpoint_dir, config=cfg)
        else:
            data = Path(args.model_config).read_bytes()
            model = model_cls(
                cfg, ToyModel.from_digest(hashlib.sha256(data).digest(), int(cfg.vocab_size))
            )
        engine = build(model, bc)
        if not args.dry_run:
            engine.save(args.output_dir)


if __name__ == "__main__":
    main()
