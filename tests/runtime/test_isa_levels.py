"""The demo question on every CPU ISA level this host can run, forced with AOTLLM_CPU_ISA
(runtime/host.py): the SmolLM2 demo engine built as aoti bf16 at TP=1 and TP=2 for the level
(our kernels, Inductor's code, ATen and oneDNN all held to it) answers "The capital of France
is Paris.", from float32 logits.

The first token is a near tie ("The" against "L", 0.08 apart in transformers float32): an
engine whose logits left it in bfloat16 rounded both to the same value on AVX2 and answered
"L'Étoile ...". The logits must also be float32 (values bf16 cannot hold) and the gap within
the bf16 weights' noise of transformers float32's gap.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from contract.layout import weight_layout_for
from contract.manifest import read_manifest
from contract.target import ISA_LEVELS, cpu_isa_level
from demo.model import ensure_demo_model
from runtime.host import cpu_flags, isa_env
from runtime.tokenizer import FastTokenizer
from tests.conftest import REPO, run_mpirun, subprocess_env

QUESTION = "What is the capital of France?"  # demo/__main__.py's
ANSWER = "The capital of France is Paris."
HOST = cpu_isa_level(cpu_flags())
# Every level with kernels of its own that this host can run (baseline has none worth serving).
LEVELS = [lv for lv in ISA_LEVELS[1:] if ISA_LEVELS.index(lv) <= ISA_LEVELS.index(HOST)]


@pytest.fixture(scope="module")
def demo_model() -> Path:
    return ensure_demo_model()


@pytest.fixture(scope="module")
def hf_first_logits(demo_model: Path) -> dict[str, torch.Tensor]:
    """transformers' logits for the first answer token, in float32 and in bfloat16."""
    from transformers import AutoModelForCausalLM

    tok = FastTokenizer(demo_model)
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                  add_generation_prompt=True)
    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=dtype)
        with torch.no_grad():
            out[name] = model(torch.tensor([ids])).logits[0, -1].float()
    return out


@pytest.mark.parametrize("level", LEVELS)
def test_the_demo_question_is_answered_at_every_isa_level(
    level: str, demo_model: Path, hf_first_logits: dict[str, torch.Tensor],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    store = tmp_path_factory.mktemp(f"isa-{level}")
    env = {**subprocess_env(), **isa_env(level)}
    tok = FastTokenizer(demo_model)
    the, el = (tok.encode(t, add_special_tokens=False)[0] for t in ("The", "L"))
    hf32, hf16 = hf_first_logits["float32"], hf_first_logits["bfloat16"]
    want_gap = float(hf32[the] - hf32[el])
    assert int(hf32.argmax()) == the and 0 < want_gap < 0.2  # the near tie
    # how far transformers' own bfloat16 is from its float32 on that gap (0.17 here)
    hf16_off = abs(float(hf16[the] - hf16[el]) - want_gap)
    for tp in (1, 2):
        build = subprocess.run(
            [sys.executable, "-m", "pipeline", "build", str(demo_model), "--tp", str(tp),
             "--backend", "aoti", "--dtype", "bfloat16", "--target", "cpu", "--store", str(store)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
        assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
        engine = Path(build.stdout.strip().splitlines()[-1])
        m = read_manifest(engine)
        assert m.target.isa == level
        assert m.weight_layout == weight_layout_for("aoti", "cpu", level, dtype="bfloat16")
        # the build's fidelity record: over its whole text, no further from transformers
        # float32 than transformers' own bfloat16 (SmolLM2 avx512_bf16: KL 0.00032 / 0.00098)
        fid = m.fidelity
        assert fid["engine"]["mean_kl"] <= fid["transformers_bfloat16"]["mean_kl"], fid
        assert (fid["engine"]["mean_abs_dlogprob"]
                <= fid["transformers_bfloat16"]["mean_abs_dlogprob"]), fid
        out = engine.parent / f"answer-{tp}.json"
        proc = run_mpirun(tp, [sys.executable, "-m", "tests.runtime.first_token_worker", str(out),
                               QUESTION, "8", str(engine)], env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        got = json.loads(out.read_text())[str(engine)]
        first = dict(got["top_logits"][0])
        print(f"{level} TP={tp}: {got['text']!r}; first token 'The' - 'L' = "
              f"{first[the] - first.get(el, float('-inf')):.4f} (transformers float32 {want_gap:.4f}"
              f", bfloat16 {want_gap + hf16_off:.4f} or {want_gap - hf16_off:.4f})")
        assert got["text"].startswith(ANSWER), (level, tp, got["text"])
        assert got["tokens"][0] == the and el in first
        # float32 logits: values bf16 cannot hold (a bf16 step is 1/8 at 25)
        assert any(float(torch.tensor(v).bfloat16()) != v for v in first.values()), first
        # The gap within two bf16 steps (1/8 each at 25) of float32's. One token's gap is a
        # noisy figure (transformers' own bf16 is 0.17 off; AVX512-BF16 TP=2 measured 0.10 off
        # with row-major weights, 0.17 with pair panels): closeness to float32 is judged over
        # the whole fidelity text above.
        assert abs((first[the] - first[el]) - want_gap) <= 0.25, (level, tp, first, hf16_off)
