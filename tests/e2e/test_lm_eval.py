"""lm-evaluation-harness against the server, scored like its `hf` model on the same weights.

Three small tasks of our own (tests/e2e/lm_eval_data; the Hub is not reachable):
- multiple choice (loglikelihood): `local-completions` sends token-id prompts with echo,
  max_tokens 1 and logprobs 1, and reads the prompt's token log-probabilities;
- perplexity (loglikelihood_rolling): the same requests over rolling windows;
- generation (generate_until) through `local-chat-completions` and the chat template.
Each is scored by the harness for our server and for `hf`; the scores and every
per-document answer must agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import MODEL
from tests.e2e.harness import Server

DATA = Path(__file__).parent / "lm_eval_data"
MAX_LENGTH = 200  # rolling windows fit the engine's 256-token context with one token out

TASKS = {
    "aotllm_mc": """
task: aotllm_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "aotllm_ppl": """
task: aotllm_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/ppl.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
    "aotllm_gen": """
task: aotllm_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, text in TASKS.items():
        (out / f"{name}.yaml").write_text(text.format(data=DATA))
    return out


@pytest.fixture(scope="module")
def lm_eval(tmp_path_factory: pytest.TempPathFactory) -> Any:
    # Offline: the json loader is built into `datasets`; nothing may try the Hub.
    cache = tmp_path_factory.mktemp("hf_datasets")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                           "HF_DATASETS_CACHE": str(cache), "TOKENIZERS_PARALLELISM": "false",
                           "OPENAI_API_KEY": "unused"}.items():
            mp.setenv(key, value)
        import lm_eval

        yield lm_eval


def _evaluate(lm_eval: Any, task_dir: Path, model: str, model_args: dict[str, Any],
              tasks: list[str], chat: bool = False) -> dict[str, Any]:
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=tasks, batch_size=1, log_samples=True,
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        apply_chat_template=chat, bootstrap_iters=0, random_seed=0, numpy_random_seed=0,
        torch_random_seed=0, fewshot_random_seed=0)
    assert out is not None
    return out


def _hf_args(checkpoint: Path, engine: Path) -> dict[str, Any]:
    return {"pretrained": str(checkpoint), "tokenizer": str(engine), "dtype": "float32",
            "device": "cpu", "max_length": MAX_LENGTH}


def _score(result: dict[str, Any], task: str, metric: str) -> float:
    return float(result["results"][task][f"{metric},none"])


def _answers(result: dict[str, Any], task: str) -> list[Any]:
    return [s["resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def test_loglikelihood_tasks_score_like_the_hf_model(server: Server, served_checkpoint: Path,
                                                     engine_dir: Path, task_dir: Path,
                                                     lm_eval: Any) -> None:
    ours = _evaluate(lm_eval, task_dir, "local-completions", {
        "model": MODEL, "base_url": f"{server.base_url}/completions",
        "tokenizer_backend": "huggingface", "tokenizer": str(engine_dir),
        "tokenized_requests": True, "max_length": MAX_LENGTH, "num_concurrent": 1,
        "max_retries": 1, "timeout": 120}, ["aotllm_mc", "aotllm_ppl"])
    hf = _evaluate(lm_eval, task_dir, "hf", _hf_args(served_checkpoint, engine_dir),
                   ["aotllm_mc", "aotllm_ppl"])
    print("lm-eval local-completions:", {t: ours["results"][t] for t in ours["results"]})
    print("lm-eval hf:", {t: hf["results"][t] for t in hf["results"]})
    for metric in ("acc", "acc_norm"):
        assert _score(ours, "aotllm_mc", metric) == _score(hf, "aotllm_mc", metric)
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert _score(ours, "aotllm_ppl", metric) == pytest.approx(
            _score(hf, "aotllm_ppl", metric), rel=1e-4)
    # Every choice's log-likelihood and greedy flag, document by document.
    for a, b in zip(_answers(ours, "aotllm_mc"), _answers(hf, "aotllm_mc"), strict=True):
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(
                [r[0] for r in a], [r[0] for r in b], strict=True):
            assert float(ll_a) == pytest.approx(float(ll_b), abs=2e-3)
            assert greedy_a == greedy_b


def test_chat_generation_task_answers_like_the_hf_model(server: Server,
                                                        served_checkpoint: Path,
                                                        engine_dir: Path, task_dir: Path,
                                                        lm_eval: Any) -> None:
    ours = _evaluate(lm_eval, task_dir, "local-chat-completions", {
        "model": MODEL, "base_url": f"{server.base_url}/chat/completions",
        "num_concurrent": 1, "max_retries": 1, "timeout": 120}, ["aotllm_gen"], chat=True)
    hf = _evaluate(lm_eval, task_dir, "hf", _hf_args(served_checkpoint, engine_dir),
                   ["aotllm_gen"], chat=True)
    print("lm-eval local-chat-completions:", ours["results"], "hf:", hf["results"])
    assert _score(ours, "aotllm_gen", "exact_match") == _score(hf, "aotllm_gen", "exact_match")
    assert _answers(ours, "aotllm_gen") == _answers(hf, "aotllm_gen")

