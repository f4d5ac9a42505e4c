"""Type-checked attributes, like nanobind's: a wrong type raises TypeError on init or set."""

from __future__ import annotations

from typing import Any, ClassVar


class Typed:
    __slots__ = ()
    # attribute -> accepted types; None in the tuple means the attribute is optional.
    _TYPES: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        types = self._TYPES.get(name)
        if types is not None and not _accepts(types, value):
            names = ", ".join("None" if t is None else t.__name__ for t in types)
            raise TypeError(
                f"{type(self).__name__}.{name}: incompatible value {value!r} (expected {names})"
            )
        object.__setattr__(self, name, value)


def _accepts(types: tuple[Any, ...], value: Any) -> bool:
    if value is None:
        return None in types
    if isinstance(value, bool) and bool not in types:
        return False  # nanobind does not convert bool to an integer or a float
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, tuple(t for t in types if t is not None))


def int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise TypeError(f"{what}: expected a list of int, got {value!r}")
    return list(value)


def int_lists(value: Any, what: str) -> list[list[int]] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{what}: expected a list of token-id lists, got {value!r}")
    return [int_list(v, what) for v in value]
