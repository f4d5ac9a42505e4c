"""Compare the importable fake with the api_surface entries (see api_surface.check_fake)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

from _surface_entries import Entry

# Names every pydantic model / Enum carries; not part of what the reference documents.
_INHERITED: set[str] = set()


def _inherited() -> set[str]:
    if not _INHERITED:
        from enum import Enum

        from pydantic import BaseModel

        _INHERITED.update(dir(BaseModel), dir(Enum), ("name", "value"))
    return _INHERITED


def resolve(name: str) -> tuple[ModuleType, Any]:
    """(deepest importable module, object) for a qualified name; LookupError if absent."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            mod = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        obj: Any = mod
        for p in parts[i:]:
            if not hasattr(obj, p):
                raise LookupError(name)
            obj = getattr(obj, p)
        return mod, obj
    raise LookupError(name)


def _attrs(cls: type) -> set[str]:
    """Data attributes a class declares: dataclass fields, slots, annotations, properties."""
    out: set[str] = set()
    for klass in cls.__mro__:
        out.update(getattr(klass, "__annotations__", {}))
        slots = klass.__dict__.get("__slots__", ())
        out.update((slots,) if isinstance(slots, str) else slots)
        out.update(n for n, v in vars(klass).items() if isinstance(v, property))
    if dataclasses.is_dataclass(cls):
        out.update(f.name for f in dataclasses.fields(cls))
    return {n for n in out if not n.startswith("_") and n != "model_config"}


def _fake_default(owner: Any, name: str, default: Any) -> Any:
    if repr(default) != "<factory>":
        return default
    if dataclasses.is_dataclass(owner):
        f = {f.name: f for f in dataclasses.fields(owner)}[name]
        return f.default_factory()  # type: ignore[misc]
    return owner.model_fields[name].get_default(call_default_factory=True)


def compare_sig(
    label: str,
    fake: inspect.Signature,
    ref: inspect.Signature,
    ns: dict[str, Any],
    owner: Any = None,
) -> list[str]:
    fp, rp = list(fake.parameters.values()), list(ref.parameters.values())
    shape = [(p.name, p.kind) for p in fp], [(p.name, p.kind) for p in rp]
    if shape[0] != shape[1]:
        return [f"{label}: fake{fake} != reference{ref}"]
    problems = []
    for f, r in zip(fp, rp, strict=True):
        if (f.default is inspect.Parameter.empty) != (r.default is inspect.Parameter.empty):
            problems.append(
                f"{label}: default of {f.name} differs ({f.default!r} vs {r.default!r})"
            )
        elif r.default is not inspect.Parameter.empty:
            want = eval(repr(r.default), ns)  # source text from api_surface, trusted
            got = _fake_default(owner, f.name, f.default)
            if got != want or type(got) is not type(want):
                problems.append(f"{label}: default of {f.name} is {got!r}, reference {want!r}")
    return problems


def _callable_sig(e: Entry, obj: Any) -> inspect.Signature:
    sig = inspect.signature(obj)
    if e.kind == "method" and inspect.isfunction(obj):  # unbound: drop self
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return sig


def _check(
    e: Entry, entries: tuple[Entry, ...], parse: Callable[[str], inspect.Signature]
) -> list[str]:
    try:
        mod, obj = resolve(e.name)
    except LookupError:
        return [] if not e.faked else [f"{e.name}: missing from the fake"]
    if not e.faked:
        return [f"{e.name}: the fake provides it but api_surface says it is not faked"]
    ns = vars(mod)
    if e.kind == "alias":
        return [] if obj is resolve(e.target)[1] else [f"{e.name} is not {e.target}"]
    if e.kind == "enum":
        got = set(obj.__members__)
        return [] if got == set(e.members) else [f"{e.name}: members {got} != {set(e.members)}"]
    if e.kind == "class":
        return _check_class(e, obj, entries, ns, parse)
    if e.kind in ("function", "method", "classmethod"):
        if e.overloads:
            fakes = getattr(obj, "_overloads", None)
            if fakes is None or len(fakes) != len(e.overloads):
                return [f"{e.name}: fake has no matching _overloads"]
            return [
                p
                for f, s in zip(fakes, e.overloads, strict=True)
                for p in compare_sig(e.name, inspect.signature(f), parse(s), ns)
            ]
        if e.sig is not None:
            owner = obj if inspect.isclass(obj) else None
            return compare_sig(e.name, _callable_sig(e, obj), parse(e.sig), ns, owner)
    return []


def _check_class(
    e: Entry,
    cls: Any,
    entries: tuple[Entry, ...],
    ns: dict[str, Any],
    parse: Callable[[str], inspect.Signature],
) -> list[str]:
    if not inspect.isclass(cls):
        return [f"{e.name}: not a class"]
    problems = []
    known = set(e.members) | {
        x.name.rsplit(".", 1)[1] for x in entries if x.name.rsplit(".", 1)[0] == e.name
    }
    if e.sig is not None:
        ref = parse(e.sig)
        known |= set(ref.parameters)  # config classes: parameters are attributes
        problems += compare_sig(e.name, inspect.signature(cls), ref, ns, cls)
    public = _attrs(cls) | {n for n in dir(cls) if not n.startswith("_")}
    if e.members and not set(e.members) <= public:
        problems.append(f"{e.name}: lacks attributes {sorted(set(e.members) - public)}")
    extra = public - known - _inherited()
    if extra:
        problems.append(f"{e.name}: has attributes the reference does not name: {sorted(extra)}")
    return problems


def compare_all(entries: tuple[Entry, ...], parse: Callable[[str], inspect.Signature]) -> list[str]:
    problems = [p for e in entries for p in _check(e, entries, parse)]
    names = {e.name for e in entries}
    for mod_name in sorted({resolve(e.name)[0].__name__ for e in entries if _exists(e)}):
        exported = getattr(importlib.import_module(mod_name), "__all__", ())
        extra = [n for n in exported if f"{mod_name}.{n}" not in names]
        if extra:
            problems.append(f"{mod_name}.__all__ exports names not in the reference: {extra}")
    return problems


def _exists(e: Entry) -> bool:
    try:
        resolve(e.name)
    except LookupError:
        return False
    return True
