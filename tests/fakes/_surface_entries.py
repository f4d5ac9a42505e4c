"""The entries of api_surface: what the reference documents, section by section."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    name: str  # fully qualified: module path + attribute path
    kind: str  # class | function | method | classmethod | enum | value | alias
    sig: str | None = None  # parameters (no self/cls); None: not checked / not callable
    overloads: tuple[str, ...] = ()  # alternative parameter lists (nanobind overloads)
    members: tuple[str, ...] = ()  # enum values; a class's data attributes
    members_documented: bool = True
    target: str = ""  # for an alias: the entry it names
    ref: str = ""  # section of the reference
    documented: bool = True
    faked: bool = True
    open: bool = False
    note: str = ""


def _f(*names: str) -> tuple[str, ...]:
    return names


T = "tensorrt_llm"
X = "tensorrt_llm.bindings.executor"
B = "tensorrt_llm.builder"
M = "tensorrt_llm.models"
L = f"{M}.LLaMAForCausalLM"

_TOP = [
    Entry(f"{T}.__version__", "value", ref="§1.3, §6"),
    Entry("tensorrt.__version__", "value", ref="§0, §1.4", note="the TensorRT wheel's version"),
    Entry(f"{T}.Mapping", "alias", target=f"{T}.mapping.Mapping", ref="§1.1"),
    Entry(f"{T}.BuildConfig", "alias", target=f"{B}.BuildConfig", ref="§1.2"),
    Entry(f"{T}.llmapi.BuildConfig", "alias", target=f"{B}.BuildConfig", ref="§1.2"),
    Entry(f"{T}.mapping.Mapping", "class", ref="§1.1", open=True,
          sig="world_size=1, rank=0, gpus_per_node=8, *, cp_size=1, cp_config=None, tp_size=1, "
          "pp_size=1, moe_cluster_size=-1, moe_tp_size=-1, moe_ep_size=-1, attn_tp_size=-1, "
          "attn_cp_size=-1, enable_attention_dp=False",
          note="ValueError unless world_size == tp_size*pp_size*cp_size and 0 <= rank < "
          "world_size; attributes = the parameter names (documented=False)"),
]

_CHECKPOINT = [
    Entry(L, "class", ref="§1.1", members=_f("config"), members_documented=False,
          note="constructed by from_hugging_face/from_checkpoint"),
    Entry(f"{L}.from_hugging_face", "classmethod", ref="§1.1",
          sig="hf_model_or_dir, dtype, /, mapping=None, quant_config=None, **kwargs",
          note="dtype in auto|float16|bfloat16|float32; load_by_shard and config overrides go "
          "through **kwargs; defaults of mapping/quant_config not in the reference"),
    Entry(f"{L}.save_checkpoint", "method", ref="§1.1", sig="output_dir, /, save_config",
          note="writes rank{N}.safetensors, and config.json when save_config (rank 0)"),
    Entry(f"{L}.from_checkpoint", "classmethod", ref="§1.2", sig="ckpt_dir, /, *, config"),
    Entry(f"{L}.quantize", "classmethod", ref="§1.1", faked=False,
          note="SmoothQuant / INT8-KV path; signature not in the reference"),
    Entry(f"{M}.MODEL_MAP", "value", ref="§1.2", note="architecture -> model class"),
    Entry(f"{M}.PretrainedConfig", "class", ref="§1.2", members_documented=False, members=_f(
        "architecture", "dtype", "logits_dtype", "vocab_size", "max_position_embeddings",
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "hidden_act", "intermediate_size", "norm_epsilon", "position_embedding_type", "mapping",
        "quantization", "extras")),
    Entry(f"{M}.PretrainedConfig.set_rank", "method", sig="rank, /", ref="§1.2"),
    Entry(f"{M}.PretrainedConfig.from_checkpoint", "classmethod", sig="ckpt_dir", ref="-",
          documented=False, note="how to get a PretrainedConfig is not in the reference"),
    Entry(f"{M}.PretrainedConfig.from_json_file", "classmethod", sig="config_file", ref="-",
          documented=False),
    Entry(f"{M}.PretrainedConfig.to_dict", "method", sig="", ref="-", documented=False),
]

_BUILD = [
    Entry(f"{B}.BuildConfig", "class", ref="§1.2",
          sig="*, max_input_len=1024, max_seq_len=None, max_batch_size=2048, max_beam_width=1, "
          "max_num_tokens=8192, opt_num_tokens=None, kv_cache_type=None, "
          "gather_context_logits=False, strongly_typed=True, plugin_config=PluginConfig(), "
          "lora_config=None, input_timing_cache=None, output_timing_cache='model.cache', "
          "weight_streaming=False, use_strip_plan=False, use_refit=False",
          note="pydantic (keyword-only, unknown fields rejected); max_* defaults are the CLI's "
          "[version unverified]; kv_cache_type None means PAGED; other defaults not given"),
    Entry(f"{B}.BuildConfig.model_fields", "value", ref="§1.2"),
    Entry(f"{T}.plugin.plugin.PluginConfig", "class", ref="§1.2",
          sig="*, gemm_plugin=None, gpt_attention_plugin='auto', nccl_plugin='auto', "
          "context_fmha=True, remove_input_padding=True, use_paged_context_fmha=True, "
          "multiple_profiles=False, tokens_per_block=32, reduce_fusion=False, "
          "use_fused_mlp=True",
          note="fields = the documented plugin flags; reduce_fusion/use_fused_mlp defaults "
          "not given"),
    Entry(f"{T}.plugin.PluginConfig", "alias", target=f"{T}.plugin.plugin.PluginConfig",
          ref="-", documented=False),
    Entry(f"{B}.build", "function", sig="model, build_config", ref="§1.2"),
    Entry(f"{B}.Engine", "class", ref="§1.2", members=_f("config", "engine"),
          members_documented=False),
    Entry(f"{B}.Engine.save", "method", sig="engine_dir, /", ref="§1.2, §1.3"),
    Entry(f"{B}.Engine.from_dir", "classmethod", sig="engine_dir, rank, /", ref="§1.3"),
    Entry(f"{B}.EngineConfig", "class", ref="§1.3", members_documented=False,
          members=_f("version", "pretrained_config", "build_config")),
    Entry(f"{B}.EngineConfig.to_dict", "method", sig="", ref="§1.3"),
    Entry(f"{B}.get_engine_version", "function", sig="engine_dir, /", ref="§1.3"),
    Entry(f"{T}.commands.build.main", "function", sig="argv=None", ref="§1.2", documented=False,
          note="the trtllm-build entry point; use the CLI (TRTLLM_BUILD_FLAGS)"),
]

_ENUMS = [
    Entry(f"{X}.ModelType", "enum", members=_f("DECODER_ONLY", "ENCODER_ONLY",
          "ENCODER_DECODER"), ref="§2.1"),
    Entry(f"{X}.BatchingType", "enum", members=_f("STATIC", "INFLIGHT"), ref="§2.1"),
    Entry(f"{X}.CapacitySchedulerPolicy", "enum", ref="§2.1",
          members=_f("MAX_UTILIZATION", "GUARANTEED_NO_EVICT", "STATIC_BATCH")),
    Entry(f"{X}.CommunicationType", "enum", members=_f("MPI",), ref="§2.1"),
    Entry(f"{X}.CommunicationMode", "enum", members=_f("LEADER", "ORCHESTRATOR"), ref="§2.2"),
    Entry(f"{X}.FinishReason", "enum", ref="§2.1", members=_f(
        "NOT_FINISHED", "END_ID", "STOP_WORDS", "LENGTH", "TIMED_OUT", "CANCELLED")),
]
