"""Convert a Hugging Face checkpoint into per-rank shards following the sharding rule,
quantizing the weights the engine's quantization covers (or taking them already quantized
from a GGUF's blocks, pipeline/gguf.py)."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file

from contract.layout import (
    FLOAT_PAIR_LAYOUTS,
    FLOAT_PANEL_LAYOUTS,
    QHEAD_LAYOUTS,
    QPANEL_LAYOUTS,
    rank_shard,
)
from contract.quant import NONE, Quantization, QuantSpec
from pipeline.progress import Progress
from runtime.models.config import ModelConfig
from runtime.models.factory import torch_dtype
from runtime.models.hf_names import llama_names
from runtime.models.panels import pack_pairs, pack_panels, pack_qpanel_weight, pairs_fit
from runtime.models.sharding import (
    QuantGetter,
    is_panel_weight,
    is_qpanel_weight,
    quant_spec_for,
    rules_for,
    shard_state_dict,
)
from runtime.quant import QTensor, quantize
from runtime.store.checkpoint import open_weights, read_model_config, write_engine_model_config


def convert_checkpoint(
    src: Path, out_dir: Path, tp: int, dtype: str, progress: Progress | None = None,
    quant: Quantization = NONE, get_quantized: QuantGetter | None = None,
    weight_layout: str = "rows",
) -> ModelConfig:
    """Write out_dir/rank{N}.safetensors for every rank and out_dir/config.json; with
    `weight_layout` "panels16" the decoder layers' float linears are stored in panels, with
    "panels16q" their quantized linears in pair panels too (where their shapes allow), with
    "panels16qh" a quantized LM head as well; "rowsqh" is "panels16qh" with float weights
    left row-major (contract/layout.py)."""
    progress = progress or Progress.silent()
    cfg, hf_cfg = read_model_config(src)
    cfg.check_tp(tp)
    get = llama_names(cfg, open_weights(src))  # Phi-3's fused tensors cut (hf_names.py)
    td = torch_dtype(dtype)
    # Each weight is quantized once (whole), whatever the number of ranks cutting it.
    done: dict[tuple[str, QuantSpec], QTensor] = {}

    def get_q(name: str, spec: QuantSpec) -> QTensor:
        if (name, spec) not in done:
            done[(name, spec)] = get_quantized(name, spec) if get_quantized else quantize(get(name), spec)
        return done[(name, spec)]

    panel_names = [r.name for r in rules_for(cfg) if is_panel_weight(r, cfg, quant, tp)]
    qpanel_specs = {r.name.removesuffix(".weight"): quant_spec_for(r, cfg, quant)
                    for r in rules_for(cfg)
                    if is_qpanel_weight(r, cfg, quant, head=weight_layout in QHEAD_LAYOUTS)}
    # A tied quantized head that the layout stores in pair panels cannot be the embedding's
    # tensor (the embedding looks its rows up row-major): the head gets a copy of its own,
    # packed, and the embedding keeps the rows (runtime/models/llama.py reads them so).
    tied_qhead = (cfg.tie_word_embeddings and quant.lm_head is not None
                  and weight_layout in QHEAD_LAYOUTS)
    if tied_qhead:
        qpanel_specs["lm_head"] = quant.lm_head
    with progress.stage("convert", total=tp * len(rules_for(cfg)), unit="tensors") as st:
        for rank in range(tp):
            shard = shard_state_dict(get, cfg, tp, rank, td, quant, get_q)
            if tied_qhead:
                for part in ("qweight", "scales", "mins"):
                    if f"embed_tokens.{part}" in shard:
                        shard[f"lm_head.{part}"] = shard[f"embed_tokens.{part}"].clone()
            if weight_layout in FLOAT_PANEL_LAYOUTS:
                for name in panel_names:
                    shard[name] = pack_panels(shard[name])
            if weight_layout in FLOAT_PAIR_LAYOUTS:  # a tied embedding too: it is the head
                for name in panel_names:
                    if pairs_fit(*shard[name].shape):
                        shard[name] = pack_pairs(shard[name])
            if weight_layout in QPANEL_LAYOUTS:
                for name, spec in qpanel_specs.items():
                    assert spec is not None
                    pack_qpanel_weight(shard, name, spec)
            st.advance(len(rules_for(cfg)))
            save_file(shard, str(out_dir / rank_shard(rank)), metadata={"rank": str(rank), "tp": str(tp)})
            del shard
    write_engine_model_config(out_dir, cfg, hf_cfg, quant=quant, weight_layout=weight_layout)
    return cfg
