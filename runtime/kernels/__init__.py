"""Our own CPU kernels (C++ sources beside this file), as torch custom ops `aotllm::*`.

The build compiles them for the engine's target ISA into the engine's `kernels.so`
(pipeline/compile/kernels.py); the exported program calls them by name, and AOTInductor's
package calls each through its C entry point (aoti_shim.h; packages built before those
existed, through the dispatcher), so the library must be loaded (`load`) before the package
is. Each op has a fake (meta) implementation here for torch.export to trace.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runtime.dist.comm import Comm

SOURCES = tuple(sorted(Path(__file__).resolve().parent.glob("*.cpp")))
HEADERS = tuple(sorted(Path(__file__).resolve().parent.glob("*.h")))  # in the cache digest
_loaded: set[Path] = set()
_library: ctypes.CDLL | None = None  # the loaded library, whose symbols the packages see

# The ops a compiled step calls, each with a C entry point aoti_torch_cpu_<op> (aoti_shim.h).
SHIM_OPS = ("linear", "linear_pairs", "linear_panel", "linear_qpanel", "linear_int8",
            "linear_int4", "paged_decode_attention", "paged_prefill_attention", "all_reduce",
            "all_gather")
# An op schema's argument type -> its C type in AOTInductor's shim ABI (aoti_shim.h).
_C_TYPES = {"Tensor": "AtenTensorHandle", "Optional[Tensor]": "AtenTensorHandle*", "int": "int64_t",
            "bool": "int32_t", "float": "double", "str": "const char*"}


def available() -> bool:
    return hasattr(torch.ops.aotllm, "paged_decode_attention")


def load(path: Path) -> None:
    """Load a compiled kernels library once per process (idempotent)."""
    path = Path(path).resolve()
    if path in _loaded:
        return
    global _library
    if not available():  # a second copy (another engine's) would register the ops twice
        # RTLD_GLOBAL: a package compiled with c_shims() calls aoti_torch_cpu_<op> and finds
        # it among the process's global symbols when it is loaded.
        _library = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        torch.ops.load_library(str(path))
        _register_fakes()
    _loaded.add(path)


def c_shim_declaration(op: str) -> str:
    """The C declaration of `op`'s entry point, from its schema (the ABI of aoti_shim.h)."""
    schema = getattr(torch.ops.aotllm, op).default._schema
    params = [f"{_C_TYPES[str(a.type)]} {a.name}" for a in schema.arguments]
    params += [f"AtenTensorHandle* ret{i}" for i in range(len(schema.returns))]
    return f"AOTITorchError aoti_torch_cpu_{op}({', '.join(params)})"


def c_shims() -> dict[torch._ops.OpOverload, list[str]]:
    """AOTInductor's `custom_ops_to_c_shims` for the loaded library: every op of SHIM_OPS it
    has an entry point for (a library built before them has none: its packages use the
    proxy executor)."""
    if _library is None:
        return {}
    return {getattr(torch.ops.aotllm, op).default: [c_shim_declaration(op)]
            for op in SHIM_OPS
            if hasattr(torch.ops.aotllm, op) and hasattr(_library, f"aoti_torch_cpu_{op}")}


def _fake(op: str) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    """Register a fake for `aotllm::op` if the loaded library has that op: an engine built
    before the op existed carries a library without it, and still loads."""
    def register(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        if hasattr(torch.ops.aotllm, op):
            torch.library.register_fake(f"aotllm::{op}")(fn)
        return fn
    return register


def _register_fakes() -> None:
    @_fake("paged_decode_attention")
    def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, ctx_lens: torch.Tensor, scale: float,
                kv_live: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
        return torch.empty_like(q)

    @_fake("paged_prefill_attention")
    def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, q_pos: torch.Tensor, scale: float,
                 kv_live: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
        return torch.empty_like(q)

    def _out(x: torch.Tensor, n: int, float_out: bool) -> torch.Tensor:
        # `float_out`: float32 whatever x is (the LM head's logits)
        return x.new_empty((*x.shape[:-1], n), dtype=torch.float32 if float_out else x.dtype)

    @_fake("linear")
    def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                float_out: bool = False) -> torch.Tensor:
        return _out(x, w.shape[0], float_out)

    _fake("linear_panel")(_linear)  # same signature and shapes, another weight order
    _fake("linear_pairs")(_linear)

    @_fake("linear_int8")
    def _linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     b: torch.Tensor | None, group_size: int,
                     float_out: bool = False) -> torch.Tensor:
        return _out(x, qweight.shape[0], float_out)

    @_fake("linear_int4")
    def _linear_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     mins: torch.Tensor | None, b: torch.Tensor | None,
                     group_size: int, float_out: bool = False) -> torch.Tensor:
        return _out(x, qweight.shape[0], float_out)

    _fake("linear_qpanel")(_linear_int4)  # the int4 signature; qweight int8 or packed int4

    @_fake("dequantize")
    def _dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                    k: int, group_size: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
        return qweight.new_empty((qweight.shape[0], k), dtype=dtype)

    @_fake("all_reduce")
    def _all_reduce(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
        return torch.empty_like(x)

    @_fake("all_gather")
    def _all_gather(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
        return x.new_empty((size * x.shape[0], *x.shape[1:]))


def slot_bytes_for(max_num_tokens: int, hidden_size: int, vocab_size: int, tp: int) -> int:
    """One rank's largest contribution to a step's collectives, in float32 bytes: the
    all-reduce of a step's hidden states (up to max_num_tokens rows), or the all-gather of
    its logits slice, which may have a row per token too (prompt log-probabilities, the
    golden prefill), up to the compiled bound of max(max_num_tokens, 6) rows
    (pipeline/compile/aoti.py)."""
    logit_rows = max(max_num_tokens, 6)
    return 4 * max(max_num_tokens * hidden_size, logit_rows * -(-vocab_size // tp))


def attach_shared_memory(comm: Comm, group: str, slot_bytes: int) -> str:
    """Give `group` a shared-memory transport when every rank is on this host; across
    hosts the ops fall back to the process group (gloo) of the same name.

    Collective over the control plane (every rank calls it). Rank 0 creates the segment,
    the others attach, and rank 0 unlinks its name once all have: nothing outlives the
    job, even a crash. Returns what the collectives now use (connect gate evidence).
    """
    # Hosts as the bootstrap saw them (hostname, boot, network namespace): two network
    # namespaces of one machine are two hosts, as they are for every other transport.
    keys = [h.key for h in comm.hosts] or comm.allgather(socket.gethostname())
    if len(set(keys)) > 1:
        return "gloo"  # the connect gate adds "across N hosts"
    name = f"/aotllm-{os.getpid()}-{secrets.token_hex(4)}" if comm.rank == 0 else ""
    name = comm.allgather(name)[0]
    if comm.rank == 0:
        torch.ops.aotllm.shm_init(group, name, 0, comm.size, slot_bytes, True)
    comm.allgather("created")
    if comm.rank != 0:
        torch.ops.aotllm.shm_init(group, name, comm.rank, comm.size, slot_bytes, False)
    comm.allgather("attached")
    if comm.rank == 0:
        torch.ops.aotllm.shm_unlink(name)
    return f"shared memory ({2 * comm.size} slots of {slot_bytes} bytes)"
