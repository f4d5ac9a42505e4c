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


# fmt: off  (a table: one entry per documented name, kept dense on purpose)


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
    Entry(f"{M}.modeling_utils.QuantConfig", "class", ref="§1.1 (quantization.* fields)",
          sig="*, quant_algo=None, kv_cache_quant_algo=None, group_size=128, "
          "has_zero_point=False, pre_quant_scale=False, exclude_modules=None", open=True,
          members=_f("quant_algo", "kv_cache_quant_algo", "group_size", "has_zero_point",
                     "pre_quant_scale", "exclude_modules"),
          note="what from_hugging_face's quant_config= takes; fields = §1.1's quantization.* "
          "keys; the class name and module are convert_checkpoint.py's import, not in "
          "shared/reference; real class has further fields (smoothquant_val, clamp_val)"),
    Entry(f"{T}.quantization.QuantAlgo", "enum", ref="§1.1 (--use_weight_only, --use_fp8)",
          members=_f("W8A16", "W4A16", "W4A16_AWQ", "W4A16_GPTQ", "W8A8_SQ_PER_CHANNEL", "FP8",
                     "NVFP4", "NO_QUANT"),
          note="str enum; the values convert_checkpoint.py's quantization flags set "
          "(weight_only_precision int8 -> W8A16, int4 -> W4A16, --use_fp8 -> FP8); names from "
          "the source, not in shared/reference"),
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
    Entry(f"{M}.PretrainedConfig.from_dict", "classmethod", sig="d, rank=0", ref="-",
          documented=False),
]

_BUILD = [
    Entry(f"{B}.BuildConfig", "class", ref="§1.2",
          sig="*, max_input_len=1024, max_seq_len=None, max_batch_size=2048, max_beam_width=1, "
          "max_num_tokens=8192, opt_num_tokens=None, kv_cache_type=None, "
          "gather_context_logits=False, strongly_typed=True, plugin_config=PluginConfig(), "
          "lora_config=None, input_timing_cache=None, output_timing_cache='model.cache', "
          "weight_streaming=False, use_strip_plan=False, use_refit=False",
          note="pydantic (keyword-only, unknown fields rejected); max_* defaults are the CLI's "
          "[version unverified]; kv_cache_type None means PAGED, else a KVCacheType: the fake "
          "refuses a plain string (only the pydantic form converts it; in the dataclass form "
          "of earlier 1.x it silently disables the paged cache); build() writes "
          "output_timing_cache relative to the working directory; other defaults not given"),
    Entry(f"{B}.BuildConfig.model_fields", "value", ref="§1.2"),
    Entry(f"{T}.llmapi.kv_cache_type.KVCacheType", "enum", ref="kv_cache_type.py@b35ac1b6",
          members=_f("CONTINUOUS", "PAGED", "DISABLED"),
          note="str enum, case-insensitive lookup; read from the source, not in "
          "shared/reference"),
    Entry(f"{T}.plugin.plugin.PluginConfig", "class", ref="§1.2",
          sig="*, dtype='float16', gemm_plugin=None, gpt_attention_plugin='auto', "
          "nccl_plugin='auto', "
          "context_fmha=True, remove_input_padding=True, use_paged_context_fmha=True, "
          "multiple_profiles=False, tokens_per_block=32, reduce_fusion=False, "
          "use_fused_mlp=True",
          note="fields = the documented plugin flags; reduce_fusion/use_fused_mlp defaults "
          "not given; unknown keys are ignored, not refused (read back what you set); an "
          "'auto' field reads back as dtype (plugin.py at 1.2.0rc2, per issue 33)"),
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

_CONFIGS = [
    Entry(f"{X}.ExecutorConfig", "class", ref="§2.1",
          sig="*, max_beam_width=1, scheduler_config=SchedulerConfig(), "
          "kv_cache_config=KvCacheConfig(), enable_chunked_context=False, "
          "normalize_log_probs=True, iter_stats_max_iterations=1000, "
          "request_stats_max_iterations=0, batching_type=BatchingType.INFLIGHT, "
          "max_batch_size=None, max_num_tokens=None, parallel_config=None, "
          "peft_cache_config=None, logits_post_processor_config=None, decoding_config=None, "
          "gpu_weights_percent=1.0, max_queue_size=None, "
          "extended_runtime_perf_knob_config=ExtendedRuntimePerfKnobConfig(), "
          "debug_config=None, recv_poll_period_ms=0, max_seq_idle_microseconds=None, "
          "spec_dec_config=None, guided_decoding_config=None, additional_model_outputs=None, "
          "cache_transceiver_config=None, gather_generation_logits=False",
          note="keyword-only in the fake: the reference lists keyword defaults, not an order; "
          "attributes settable after construction; None defaults where the reference gives "
          "none"),
    Entry(f"{X}.SchedulerConfig", "class", ref="§2.1",
          sig="capacity_scheduler_policy=CapacitySchedulerPolicy.GUARANTEED_NO_EVICT, "
          "context_chunking_policy=None, dynamic_batch_config=None",
          note="fields are read-only after construction"),
    Entry(f"{X}.KvCacheConfig", "class", ref="§2.1",
          sig="enable_block_reuse=True, max_tokens=None, max_attention_window=None, "
          "sink_token_length=None, free_gpu_memory_fraction=None, host_cache_size=None, "
          "onboard_blocks=True, cross_kv_cache_fraction=None, "
          "secondary_offload_min_priority=None, event_buffer_max_size=0, *, "
          "enable_partial_reuse=True, copy_on_partial_reuse=True, use_uvm=False, "
          "runtime_defaults=None"),
    Entry(f"{X}.ParallelConfig", "class", ref="§2.1",
          sig="communication_type=CommunicationType.MPI, "
          "communication_mode=CommunicationMode.LEADER, device_ids=None, participant_ids=None, "
          "orchestrator_config=None, num_nodes=None",
          note="the fake implements LEADER without participant_ids only"),
    Entry(f"{X}.OrchestratorConfig", "class", ref="§2.1",
          sig="is_orchestrator=True, worker_executable_path='', orch_leader_comm=None, "
          "spawn_processes=True", note="ORCHESTRATOR mode is not faked"),
    Entry(f"{X}.ExtendedRuntimePerfKnobConfig", "class", ref="§2.1", documented=False,
          sig="multi_block_mode=True, cuda_graph_mode=False, cuda_graph_cache_size=0",
          note="the reference gives the fields, not the class name"),
]

_GUIDED = [
    # Not in the shared reference: read from TensorRT-LLM's source (docs/trtllm.md
    # "Structured output"), cpp/tensorrt_llm/nanobind/executor/executorConfig.cpp and
    # request.cpp, so documented (ref "source").
    Entry(f"{X}.GuidedDecodingConfig", "class", ref="source",
          sig="backend, encoded_vocab=None, tokenizer_str=None, stop_token_ids=None",
          note="executorConfig.cpp; read-write properties of the same names"),
    Entry(f"{X}.GuidedDecodingConfig.GuidedDecodingBackend", "enum", ref="source",
          members=_f("XGRAMMAR", "LLGUIDANCE"),
          note="the C++ runtime (engine path) refuses LLGUIDANCE (guidedDecoder.cpp)"),
    Entry(f"{X}.GuidedDecodingParams", "class", ref="source",
          sig="guide_type, guide=None", note="request.cpp; guide_type and guide read-only"),
    Entry(f"{X}.GuidedDecodingParams.GuideType", "enum", ref="source",
          members=_f("JSON", "JSON_SCHEMA", "REGEX", "EBNF_GRAMMAR", "STRUCTURAL_TAG"),
          note="the C++ GuidedDecoder has no STRUCTURAL_TAG branch (guidedDecoder.cpp)"),
]

_REQUESTS = [
    Entry(f"{X}.Request", "class", ref="§2.1", open=True,
          sig="input_token_ids, max_tokens, *, streaming=False, "
          "sampling_config=SamplingConfig(), output_config=OutputConfig(), end_id=None, "
          "pad_id=None, position_ids=None, bad_words=None, stop_words=None, client_id=None, "
          "return_all_generated_tokens=False, priority=0.5, num_return_sequences=1, "
          "guided_decoding_params=None, allotted_time_ms=None",
          note="no max_new_tokens; max_tokens is read-only once constructed; "
          "stop_words/bad_words are lists of token-id lists"),
    Entry(f"{X}.SamplingConfig", "class", ref="§2.1", open=True,
          sig="beam_width=1, *, top_k=None, top_p=None, temperature=None, min_tokens=None, "
          "repetition_penalty=None, presence_penalty=None, frequency_penalty=None, "
          "length_penalty=None, seed=None, num_return_sequences=None, min_p=None",
          note="keyword defaults (None) not given in the reference; seed None means seed 0 "
          "(NVIDIA/TensorRT-LLM #1000, #2411): draw one per request"),
    Entry(f"{X}.OutputConfig", "class", ref="§2.1",
          sig="return_log_probs=False, return_context_logits=False, "
          "return_generation_logits=False, exclude_input_from_output=False, "
          "return_encoder_output=False, return_perf_metrics=False, "
          "additional_model_outputs=None",
          note="only exclude_input_from_output's default is given"),
    Entry(f"{X}.Response", "class", ref="§2.1",
          members=_f("request_id", "client_id", "error_msg", "result")),
    Entry(f"{X}.Response.has_error", "method", sig="", ref="§2.1"),
    Entry(f"{X}.Result", "class", ref="§2.1", members=_f(
        "is_final", "output_token_ids", "cum_log_probs", "log_probs", "context_logits",
        "generation_logits", "finish_reasons", "sequence_index", "is_sequence_final",
        "decoding_iter", "request_perf_metrics", "additional_outputs")),
    Entry(f"{X}.IterationStats", "class", ref="§2.1", members=_f(
        "timestamp", "iter", "iter_latency_ms", "new_active_requests_queue_latency_ms",
        "num_new_active_requests", "num_active_requests", "num_queued_requests",
        "num_completed_requests", "max_num_active_requests", "gpu_mem_usage", "cpu_mem_usage",
        "pinned_mem_usage", "kv_cache_stats", "cross_kv_cache_stats",
        "inflight_batching_stats", "specdec_stats")),
    Entry(f"{X}.IterationStats.to_json_str", "method", sig="", ref="§2.1"),
    Entry(f"{X}.KvCacheStats", "class", ref="§2.1", members=_f(
        "max_num_blocks", "free_num_blocks", "used_num_blocks", "tokens_per_block",
        "alloc_total_blocks", "alloc_new_blocks", "reused_blocks", "missed_blocks",
        "cache_hit_rate")),
    Entry(f"{X}.InflightBatchingStats", "class", ref="§2.1", members=_f(
        "num_scheduled_requests", "num_context_requests", "num_gen_requests",
        "num_paused_requests", "num_ctx_tokens", "micro_batch_id",
        "avg_num_decoded_tokens_per_iter")),
]

E = f"{X}.Executor"
_EXECUTOR = [
    Entry(E, "class", sig="model_path, model_type, executor_config", ref="§2.1",
          note="the (encoder_path, decoder_path, …) and (engine_buffer, json_config_str, …) "
          "overloads are not faked"),
    Entry(f"{E}.enqueue_request", "method", sig="request, /", ref="§2.1"),
    Entry(f"{E}.enqueue_requests", "method", sig="requests, /", ref="§2.1"),
    Entry(f"{E}.await_responses", "method", ref="§2.1",
          overloads=("timeout=None", "id, /, timeout=None", "ids, /, timeout=None"),
          note="timeout is a datetime.timedelta; the ids form returns one list per id"),
    Entry(f"{E}.get_num_responses_ready", "method", sig="id=None", ref="§2.1"),
    Entry(f"{E}.cancel_request", "method", sig="id, /", ref="§2.1"),
    Entry(f"{E}.get_latest_iteration_stats", "method", sig="", ref="§2.1"),
    Entry(f"{E}.get_latest_request_stats", "method", sig="", ref="§2.1"),
    Entry(f"{E}.get_latest_debug_tensors", "method", sig="", ref="§2.1"),
    Entry(f"{E}.can_enqueue_requests", "method", sig="", ref="§2.1"),
    Entry(f"{E}.shutdown", "method", sig="", ref="§2.1, §2.2"),
    Entry(f"{E}.get_kv_cache_event_manager", "method", sig="", ref="§2.1"),
    Entry(f"{E}.__enter__", "method", ref="§2.1"),
    Entry(f"{E}.__exit__", "method", ref="§2.1"),
]

U = f"{T}._utils"
_MPI = [  # tensorrt_llm/_utils.py at 1.2.0rc2 (b35ac1b6), read from the source: not in the
    # shared reference. Importing tensorrt_llm runs `local_comm = mpi_comm().Split_type(...)`.
    *(Entry(f"{U}.{fn}", "function", sig="", ref="_utils.py@b35ac1b6",
            note="the MPI world as TensorRT-LLM's libmpi sees it")
      for fn in ("mpi_comm", "mpi_rank", "mpi_world_size", "global_mpi_rank", "global_mpi_size",
                 "local_mpi_rank", "local_mpi_size")),
    Entry(f"{U}.local_comm", "value", ref="_utils.py@b35ac1b6",
          note="made by a COMM_WORLD collective at import time"),
    Entry(f"{U}.OMPI_COMM_TYPE_HOST", "value", ref="_utils.py@b35ac1b6"),
]

_NOT_FAKED = [
    Entry(f"{T}.LLM", "class", ref="§2.3", faked=False, note="PyTorch-backend LLM API"),
    Entry(f"{T}._tensorrt_engine.LLM", "class", ref="§2.3", faked=False),
    Entry(f"{T}.runtime.ModelRunnerCpp.from_dir", "classmethod", ref="§2.3", faked=False,
          open=True, sig="engine_dir, *, rank, max_batch_size, max_input_len, max_output_len, "
          "max_beam_width, kv_cache_free_gpu_memory_fraction, max_tokens_in_paged_kv_cache, "
          "kv_cache_enable_block_reuse=False, enable_chunked_context=False, cuda_graph_mode, "
          "device_ids, is_orchestrator_mode=False, gather_generation_logits"),
    Entry(f"{T}._deprecation.emit_engine_arch_deprecation", "function", sig="", ref="§0",
          faked=False, note="first release shipping it unconfirmed"),
]

ENTRIES: tuple[Entry, ...] = (
    *_TOP, *_CHECKPOINT, *_BUILD, *_ENUMS, *_CONFIGS, *_GUIDED, *_REQUESTS, *_EXECUTOR, *_MPI,
    *_NOT_FAKED
)

# trtllm-build flags the reference documents (§1.2); LoRA and speculative flags are not.
TRTLLM_BUILD_FLAGS: tuple[str, ...] = (
    "--checkpoint_dir", "--model_config", "--output_dir", "--max_batch_size", "--max_input_len",
    "--max_beam_width", "--max_num_tokens", "--max_seq_len", "--max_decoder_seq_len",
    "--opt_num_tokens", "--kv_cache_type", "--paged_kv_cache", "--workers", "--gemm_plugin",
    "--gpt_attention_plugin", "--context_fmha", "--remove_input_padding",
    "--use_paged_context_fmha", "--multiple_profiles", "--tokens_per_block", "--reduce_fusion",
    "--use_fused_mlp", "--nccl_plugin", "--strip_plan", "--weight_streaming", "--fast_build",
    "--input_timing_cache", "--output_timing_cache", "--log_level", "--dry_run",
)
