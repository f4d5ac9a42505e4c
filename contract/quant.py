"""How an engine's weights are quantized, as recorded in its manifest (plain data).

One weight format per kind, which also holds llama.cpp's GGUF blocks exactly:

  int8   w[n, k] = scale[n, g] * q[n, k]            q int8, g = k // group_size
  int4   w[n, k] = scale[n, g] * q[n, k] + min[n, g]  q in 0..15, two per byte
         symmetric (no zero point): min = -8 * scale, so w = scale * (q - 8)

scale and min are float16 (GGUF's own block scales, so Q8_0, Q4_0 and Q4_1 blocks are held
bit for bit). Groups run along the input dimension K; a group size of 0 means one group per
output channel (the whole row). The last group of a row may be shorter when K is not a
multiple of the group size. Packing (LAYOUT 1, what runtime/kernels/quant_linear.cpp reads):
int8 q is [N, K] row-major; int4 q is [N, K / 2] bytes where each run of 32 values takes 16
bytes, byte j holding value j in its low nibble and value j + 16 in its high one (GGUF's
Q4_0/Q4_1 `qs`); scales and mins are [N, number of groups].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# `--quant` names, as TensorRT-LLM's quantize.py `--qformat` spells them; fp8 only for the
# trtllm backend on an FP8-capable GPU (TensorRT-LLM's own kernels).
SCHEMES = ("none", "int8_wo", "int4_wo")
TRTLLM_ONLY_SCHEMES = ("fp8",)
ALL_SCHEMES = (*SCHEMES, *TRTLLM_ONLY_SCHEMES)
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP_SIZE = 128
LAYOUT = 1
KINDS = ("int8", "int4")
PACK = 32  # int4 values are packed in runs of 32 (16 bytes): K must be a multiple of it


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """The format of one family of tensors (the decoder's linears, or the LM head)."""

    kind: str  # "int8" | "int4"
    group_size: int  # along K; 0: one group per output channel
    zero_point: bool = False  # int4 only: a min per group (Q4_1); else symmetric

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"quantized kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if type(self.group_size) is not int or self.group_size < 0:
            raise ValueError(f"group size {self.group_size!r} is not a non-negative integer")
        if self.group_size and self.group_size % PACK:
            raise ValueError(f"group size {self.group_size} is not a multiple of {PACK}")
        if self.kind == "int8" and self.zero_point:
            raise ValueError("int8 weights are symmetric (no zero point)")

    def groups(self, k: int) -> int:
        """Number of groups along an input dimension of k."""
        return 1 if self.group_size == 0 else -(-k // self.group_size)

    def group_of(self, k: int) -> int:
        """The group size of a row of k inputs (the whole row when per channel)."""
        return self.group_size or k

    def describe(self) -> str:
        g = "per channel" if self.group_size == 0 else f"group {self.group_size}"
        zp = ", zero point" if self.zero_point else ""
        return f"{self.kind} {g}{zp}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "group_size": self.group_size, "zero_point": self.zero_point}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantSpec:
        return cls(kind=d["kind"], group_size=d["group_size"], zero_point=bool(d.get("zero_point")))


@dataclass(frozen=True, slots=True)
class Quantization:
    """An engine's quantization: none, or the format of its linears and (optionally) head.

    `lm_head` also covers the embedding when the model ties the two (one tensor, bound to
    both). `source` says where the quantized values came from: "" when the build quantized
    a floating-point checkpoint, else the GGUF block types it took over unchanged.
    """

    scheme: str = "none"
    linear: QuantSpec | None = None
    lm_head: QuantSpec | None = None
    source: str = ""
    layout: int = LAYOUT

    def __post_init__(self) -> None:
        if self.scheme not in ALL_SCHEMES:
            raise ValueError(f"quantization scheme must be one of {', '.join(ALL_SCHEMES)}, "
                             f"got {self.scheme!r}")
        if self.scheme in ("none", *TRTLLM_ONLY_SCHEMES):
            if self.linear is not None or self.lm_head is not None:
                raise ValueError(f"scheme {self.scheme!r} quantizes no tensors of ours")
        elif self.linear is None or self.linear.kind != self.scheme.split("_")[0]:
            raise ValueError(f"scheme {self.scheme!r} needs {self.scheme.split('_')[0]} linears")
        if self.layout != LAYOUT:
            raise ValueError(f"quantized weight layout {self.layout} is not supported "
                             f"(this build reads layout {LAYOUT})")

    @property
    def enabled(self) -> bool:
        return self.scheme != "none"

    def describe(self) -> str:
        if not self.enabled:
            return "none"
        if self.linear is None:
            return self.scheme
        parts = [f"{self.scheme}: linears {self.linear.describe()}"]
        parts.append(f"lm_head {self.lm_head.describe()}" if self.lm_head else "lm_head not quantized")
        if self.source:
            parts.append(f"from {self.source}")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"scheme": self.scheme, "layout": self.layout}
        if self.linear is not None:
            d["linear"] = self.linear.to_dict()
        if self.lm_head is not None:
            d["lm_head"] = self.lm_head.to_dict()
        if self.source:
            d["source"] = self.source
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Quantization:
        if not d:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"quantization is a JSON {type(d).__name__}, not an object")
        return cls(
            scheme=d["scheme"],
            linear=QuantSpec.from_dict(d["linear"]) if d.get("linear") else None,
            lm_head=QuantSpec.from_dict(d["lm_head"]) if d.get("lm_head") else None,
            source=str(d.get("source", "")),
            layout=d.get("layout", LAYOUT),
        )


NONE = Quantization()
