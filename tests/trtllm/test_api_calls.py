"""Every call the TensorRT-LLM backend makes into `tensorrt_llm` (and `tensorrt`), listed from
its source with `ast`, exists in shared/reference/tensorrt-llm-1.2-api.md with the same
signature (tests/fakes/api_surface.py), and every attribute it reads is documented.

TensorRT-LLM objects are reached only through the receivers below, per file (a naming
convention of the adapter code: `ex` is always a bindings Executor, `adapter` is ours); a
`tensorrt_llm` import bound to any other name fails the test.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from tests.conftest import REPO

X = "tensorrt_llm.bindings.executor"
E = f"{X}.Executor"
_EXEC = {"ex": E, "self._ex": E, "self.executor": E, "st.executor": E}
RECEIVERS: dict[str, dict[str, str]] = {
    "pipeline/compile/trtllm.py": {
        "tllm": "tensorrt_llm", "trt": "tensorrt",
        "model": "tensorrt_llm.models.LLaMAForCausalLM", "engine": "tensorrt_llm.builder.Engine",
    },
    "pipeline/compile/trtllm_golden.py": _EXEC,
    "runtime/executors/trtllm.py": {
        "tx": X, "self._tx": X, **_EXEC, "resp": f"{X}.Response", "result": f"{X}.Result",
        "it": f"{X}.IterationStats", "kv": f"{X}.KvCacheStats",
        "ifb": f"{X}.InflightBatchingStats",
    },
    "serve/backends/trtllm.py": {"tensorrt_llm": "tensorrt_llm", "tensorrt": "tensorrt", **_EXEC},
}
MODULE_STRINGS = {"tensorrt_llm": "tllm", "tensorrt": "trt", X: "tx"}  # import_module targets


@dataclass(frozen=True)
class Use:
    file: str
    line: int
    name: str  # qualified reference name
    kind: str  # "call" | "attr"
    n_positional: int = 0
    keywords: tuple[str, ...] = ()


def _uses(rel: str) -> list[Use]:
    tree = ast.parse((REPO / rel).read_text())
    recv = dict(RECEIVERS[rel])
    for node in ast.walk(tree):  # `from tensorrt_llm.x import Y` binds Y
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
                "tensorrt_llm", "tensorrt"):
            for alias in node.names:
                recv[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("tensorrt_llm", "tensorrt"):
                    assert (alias.asname or alias.name) in recv, f"{rel}: import {alias.name}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value.split(".")[0] in ("tensorrt_llm", "tensorrt") and " " not in node.value:
            assert node.value in MODULE_STRINGS, f"{rel}:{node.lineno}: module {node.value!r}"

    def qualify(expr: ast.expr) -> str | None:
        text = ast.unparse(expr)
        if text in recv:
            return recv[text]
        if isinstance(expr, ast.Attribute):
            base = qualify(expr.value)
            return None if base is None else f"{base}.{expr.attr}"
        return None

    out: list[Use] = []
    call_funcs = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = qualify(node.func)
            if name is not None:
                assert not any(isinstance(a, ast.Starred) for a in node.args), ast.unparse(node)
                assert all(k.arg for k in node.keywords), f"{rel}: **kwargs in {ast.unparse(node)}"
                out.append(Use(rel, node.lineno, name, "call", len(node.args),
                               tuple(k.arg for k in node.keywords if k.arg)))
                call_funcs.add(id(node.func))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in call_funcs \
                and isinstance(node.ctx, ast.Load) and qualify(node.value) is not None:
            out.append(Use(rel, node.lineno, f"{qualify(node.value)}.{node.attr}", "attr"))
    return out


def _documented(api: ModuleType, name: str) -> bool:
    """The entry itself, not what an alias resolves to, must be in the reference."""
    api.entry(name)  # SurfaceError when absent
    return all(e.documented for e in api.ENTRIES if e.name == name)


def _check(api: ModuleType, use: Use) -> str | None:
    where = f"{use.file}:{use.line} {use.name}"
    try:
        if use.kind == "call":
            if not _documented(api, use.name):
                return f"{where}: not documented in the reference"
            api.check_call_shape(use.name, use.n_positional, use.keywords)
            return None
        parent, attr = use.name.rsplit(".", 1)
        try:
            ok = _documented(api, use.name)
            return None if ok else f"{where}: not documented in the reference"
        except api.SurfaceError:
            p = api.entry(parent)
            if attr in p.members and p.members_documented:
                return None
            return f"{where}: {attr!r} is not a documented member of {parent}"
    except api.SurfaceError as err:
        return f"{where}: {err}"


def test_every_tensorrt_llm_call_is_in_the_reference(trtllm_fake: ModuleType) -> None:
    import api_surface

    uses = [u for rel in RECEIVERS for u in _uses(rel)]
    problems = [p for u in uses if (p := _check(api_surface, u)) is not None]
    assert problems == [], "\n".join(problems)
    calls = {u.name.removeprefix(X + ".") for u in uses if u.kind == "call"}
    # The list really covers the backend (a renamed receiver would silently drop calls).
    assert {
        "Executor", "Executor.enqueue_request", "Executor.await_responses",
        "Executor.cancel_request", "Executor.get_latest_iteration_stats", "Executor.shutdown",
        "Executor.can_enqueue_requests", "Request", "SamplingConfig", "OutputConfig",
        "KvCacheConfig", "ExecutorConfig", "SchedulerConfig", "ParallelConfig",
        "Response.has_error", "tensorrt_llm.Mapping", "tensorrt_llm.BuildConfig",
        "tensorrt_llm.models.LLaMAForCausalLM.from_hugging_face", "tensorrt_llm.builder.build",
        "tensorrt_llm.builder.Engine.save", "tensorrt_llm.plugin.plugin.PluginConfig",
        "tensorrt_llm._utils.mpi_rank", "tensorrt_llm._utils.mpi_world_size",
    } <= calls, sorted(calls)
    # The converted model is built in memory: a checkpoint written beside it was never read.
    assert "tensorrt_llm.models.LLaMAForCausalLM.save_checkpoint" not in calls
    attrs = {u.name for u in uses if u.kind == "attr"}
    assert {"tensorrt_llm.__version__", "tensorrt.__version__", f"{X}.Result.output_token_ids",
            f"{X}.KvCacheStats.max_num_blocks", f"{X}.ModelType.DECODER_ONLY"} <= attrs


def test_the_listing_catches_a_wrong_call(trtllm_fake: ModuleType, tmp_path: Path) -> None:
    import api_surface

    bad = [Use("x", 1, f"{X}.Request", "call", 2, ("max_new_tokens",)),
           Use("x", 2, "tensorrt_llm.Mapping", "call", 4, ()),
           Use("x", 3, f"{E}.await_responses", "call", 0, ("timeout_ms",)),
           Use("x", 4, f"{X}.Result.tokens", "attr"),
           Use("x", 5, "tensorrt_llm.plugin.PluginConfig", "call", 0, ())]
    assert [u.line for u in bad if _check(api_surface, u) is None] == []


def test_build_config_keeps_the_default_kv_cache_and_times_kernels_once(
        trtllm_fake: ModuleType) -> None:
    """kv_cache_type stays unset (PAGED): the string "paged" only works where BuildConfig is
    pydantic; the timing cache is named (the staging directory), never BuildConfig's default
    `model.cache` in the working directory."""
    [call] = [u for u in _uses("pipeline/compile/trtllm.py")
              if u.name == "tensorrt_llm.BuildConfig"]
    assert "kv_cache_type" not in call.keywords
    assert {"input_timing_cache", "output_timing_cache"} <= set(call.keywords)
