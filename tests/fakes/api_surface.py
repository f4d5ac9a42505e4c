"""Machine-readable TensorRT-LLM 1.2.x surface, from shared/reference/tensorrt-llm-1.2-api.md.

Every class, function, method, enum and field the reference names, with its signature as the
fake implements it. Use it to check that a call an adapter makes exists in the reference with
the same signature (`check_call`), and that the fake matches this list (`check_fake`).

Signatures are written as Python parameter lists. Conventions where the reference is silent:
- a parameter the reference shows only at a call site or as a placeholder (`enqueue_request
  (req)`, `save_checkpoint(output_dir, ...)`) is positional-only: pass it positionally and the
  call works whatever the real name is;
- a keyword the reference shows without a default has the default noted in `note`;
- `open=True`: the reference elides further parameters ("…"); the fake has only those listed.
`documented=False` marks what the fake needs but the reference does not name (avoid it).

Import it as `import api_surface` once tests/fakes is on sys.path (conftest_helper does that).
"""

from __future__ import annotations

import ast
import inspect
from typing import Any

from _surface_entries import ENTRIES, TRTLLM_BUILD_FLAGS, Entry

__all__ = [
    "ENTRIES", "TRTLLM_BUILD_FLAGS", "Entry", "SurfaceError", "check_call", "check_call_shape",
    "check_fake", "entry", "signatures",
]  # fmt: skip


class SurfaceError(TypeError):
    """A call or an object that does not match the reference."""


def _build_index() -> dict[str, Entry]:
    out: dict[str, Entry] = {}
    for e in ENTRIES:
        if e.name in out:
            raise ValueError(f"duplicate surface entry {e.name}")
        out[e.name] = e
    return out


_INDEX: dict[str, Entry] | None = None


def entry(name: str) -> Entry:
    """The entry for a qualified name (aliases resolved); SurfaceError if the reference lacks it."""
    global _INDEX
    if _INDEX is None:
        _INDEX = _build_index()
    e = _INDEX.get(name)
    if e is None:
        raise SurfaceError(f"{name} is not in the TensorRT-LLM 1.2 reference")
    return entry(e.target) if e.kind == "alias" else e


def signatures(name: str) -> list[inspect.Signature]:
    """The reference signature(s) of a callable entry, as inspect.Signature objects."""
    e = entry(name)
    sigs = e.overloads or ((e.sig,) if e.sig is not None else ())
    if not sigs:
        raise SurfaceError(f"{name} ({e.kind}) has no call signature in the reference")
    return [parse_sig(s) for s in sigs]


class _Default:
    """A default as source text (evaluated only when comparing with the fake)."""

    def __init__(self, src: str) -> None:
        self.src = src

    def __repr__(self) -> str:
        return self.src


def parse_sig(params: str) -> inspect.Signature:
    fn = ast.parse(f"def _({params}): pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    a = fn.args
    P = inspect.Parameter
    out: list[inspect.Parameter] = []
    positional = [(x, P.POSITIONAL_ONLY) for x in a.posonlyargs] + [
        (x, P.POSITIONAL_OR_KEYWORD) for x in a.args
    ]
    pos_defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for (arg, kind), d in zip(positional, pos_defaults, strict=True):
        out.append(P(arg.arg, kind, default=P.empty if d is None else _Default(ast.unparse(d))))
    if a.vararg:
        out.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append(
            P(arg.arg, P.KEYWORD_ONLY, default=P.empty if d is None else _Default(ast.unparse(d)))
        )
    if a.kwarg:
        out.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(out)


def check_call(name: str, *args: Any, **kwargs: Any) -> inspect.Signature:
    """Check a concrete call (`self` excluded) against the reference; returns the overload that
    accepts it, raises SurfaceError naming the reference signature(s) otherwise."""
    sigs = signatures(name)
    for sig in sigs:
        try:
            sig.bind(*args, **kwargs)
        except TypeError:
            continue
        return sig
    shown = " | ".join(f"{name.rsplit('.', 1)[-1]}{s}" for s in sigs)
    raise SurfaceError(
        f"call {name}(<{len(args)} positional>, {sorted(kwargs)}) does not match the reference: "
        f"{shown}"
    )


def check_call_shape(
    name: str, n_positional: int = 0, keywords: tuple[str, ...] = ()
) -> inspect.Signature:
    """Like check_call for a call seen in source code: how many positional arguments, which
    keyword names (e.g. from an ast.Call of adapter code)."""
    return check_call(name, *([None] * n_positional), **dict.fromkeys(keywords))


def check_fake() -> list[str]:
    """Problems where the importable `tensorrt_llm` (the fake) differs from this list."""
    from _surface_compare import compare_all

    return compare_all(ENTRIES, parse_sig)
