"""Quantized weights (format: contract/quant.py): quantize, pack, dequantize, and cut a
quantized tensor into rank shards the way runtime/models/sharding.py cuts a float one.

A `QTensor` is one full (or one rank's) quantized weight with its values unpacked (int8,
or uint8 0..15 for int4) while the build shards it; `packed()` gives the tensors a rank's
shard stores, in the layout the kernels read. `dequantize_packed` is the reference the
kernels match and what eager engines run: float32 values, cast to the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from contract.errors import BuildError
from contract.layout import QHEAD_LAYOUTS, QPANEL_LAYOUTS
from contract.quant import PACK, SCHEMES, Quantization, QuantSpec

FP16_MAX = 65504.0


@dataclass(frozen=True, slots=True)
class QTensor:
    spec: QuantSpec
    q: torch.Tensor  # [N, K] int8 (int8) or uint8 0..15 (int4), unpacked
    scales: torch.Tensor  # [N, groups] float16
    mins: torch.Tensor | None  # [N, groups] float16 (int4 with a zero point), else None
    group: int  # the actual group size along K (K itself when per channel)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        return _dequant(self.q, self.scales, self.mins, self.spec.kind, self.group)

    def packed(self) -> dict[str, torch.Tensor]:
        """The tensors a shard stores for this weight (suffix -> tensor), kernel layout."""
        q = pack_int4(self.q) if self.spec.kind == "int4" else self.q
        out = {"qweight": q.contiguous(), "scales": self.scales.contiguous()}
        if self.mins is not None:
            out["mins"] = self.mins.contiguous()
        return out


# ---- quantizing floating-point weights ---------------------------------------------------

def _grouped(w: torch.Tensor, group: int) -> tuple[torch.Tensor, int]:
    """[N, K] -> [N, groups, group] (zero-padded at the end when K % group != 0)."""
    n, k = w.shape
    groups = -(-k // group)
    if groups * group != k:
        w = torch.nn.functional.pad(w, (0, groups * group - k))
    return w.view(n, groups, group), k


def _ungroup(v: torch.Tensor, k: int) -> torch.Tensor:
    return v.reshape(v.shape[0], -1)[:, :k]


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


def quantize(w: torch.Tensor, spec: QuantSpec) -> QTensor:
    """Quantize a float [N, K] weight (computed in float32)."""
    w = w.float()
    k = w.shape[1]
    group = spec.group_of(k)
    if spec.kind == "int4" and k % PACK:
        raise BuildError(f"int4 weights need in_features divisible by {PACK}, this one has {k}",
                         "use --quant int8_wo for this model")
    g, _ = _grouped(w, group)
    if spec.kind == "int8":
        s = _fp16(g.abs().amax(-1) / 127)
        sf = s.float().unsqueeze(-1)
        q = torch.where(sf > 0, g / sf.clamp_min(1e-30), torch.zeros_like(g)).round().clamp(-127, 127)
        return QTensor(spec, _ungroup(q, k).to(torch.int8), s, None, group)
    if spec.zero_point:
        q, s, m = _int4_asymmetric(g)
        return QTensor(spec, _ungroup(q, k), s, m, group)
    q, s = _int4_symmetric(g)
    return QTensor(spec, _ungroup(q, k), s, None, group)


# Candidate scales for symmetric int4: the group's largest-magnitude value maps to level
# -t or +t (Q4_0 maps it to -8); the candidate with the least squared error wins per group.
_INT4_STEPS = (7.0, 7.25, 7.5, 7.75, 8.0, 8.25, 8.5, 8.75, 9.0, 9.5)


def _int4_symmetric(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, G, group] float32 -> q uint8 0..15 (w = s * (q - 8)), s float16 [N, G].

    A small search over scales per group (llama.cpp's Q4_0 takes the first candidate only,
    t = -8): each candidate is rounded to float16 first, so the error measured is the one
    the engine will have; each candidate's levels are then refitted once with their
    least-squares scale (sum c*w / sum c^2, c = q - 8), itself a candidate. SmolLM2, mean KL
    over 10240 tokens (bench/quant_accuracy.py): groups of 32 0.26563 -> 0.26053 (llama.cpp's
    Q4_0: 0.26526), groups of 128 0.43034 -> 0.42138. A second refit lowered the weights'
    squared error again but not the KL (0.26264).
    """
    idx = g.abs().argmax(-1, keepdim=True)
    peak = g.gather(-1, idx)  # signed value of largest magnitude [N, G, 1]
    best_q = best_s = best_err = None
    for t in _INT4_STEPS:
        for sign in (-1.0, 1.0):
            s = _fp16(peak.squeeze(-1) / (sign * t))
            for refit in (False, True):
                sf = s.float().unsqueeze(-1)
                safe = torch.where(sf != 0, sf, torch.ones_like(sf))
                q = torch.where(sf != 0, (g / safe).round() + 8, torch.full_like(g, 8.0)).clamp(0, 15)
                err = ((q - 8) * sf - g).square().sum(-1)
                if best_err is None:
                    best_q, best_s, best_err = q, s, err
                else:
                    better = err < best_err
                    best_err = torch.where(better, err, best_err)
                    best_s = torch.where(better, s, best_s)
                    best_q = torch.where(better.unsqueeze(-1), q, best_q)
                if not refit:  # the least-squares scale for these levels, tried next
                    c = q - 8
                    den = c.square().sum(-1)
                    s = _fp16(torch.where(den > 0, (c * g).sum(-1) / den.clamp_min(1.0), s.float()))
    assert best_q is not None and best_s is not None
    return best_q.to(torch.uint8), best_s


def _int4_asymmetric(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max int4 with a zero point (llama.cpp's Q4_1): w = s * q + m, q 0..15."""
    lo, hi = g.amin(-1), g.amax(-1)
    s = _fp16((hi - lo) / 15)
    m = _fp16(lo)
    sf, mf = s.float().unsqueeze(-1), m.float().unsqueeze(-1)
    safe = torch.where(sf != 0, sf, torch.ones_like(sf))
    q = torch.where(sf != 0, ((g - mf) / safe).round(), torch.zeros_like(g)).clamp(0, 15)
    return q.to(torch.uint8), s, m


# ---- packing and dequantizing -------------------------------------------------------------

def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] uint8 0..15 -> [N, K / 2]: per run of 32, byte j = q[j] | q[j + 16] << 4."""
    n, k = q.shape
    r = q.reshape(n, k // PACK, 2, PACK // 2)
    return (r[:, :, 0] | (r[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: [N, K / 2] -> [N, K] uint8 0..15."""
    n, half = packed.shape
    r = packed.reshape(n, half // (PACK // 2), 1, PACK // 2)
    return torch.cat((r & 15, r >> 4), dim=2).reshape(n, half * 2)


def _dequant(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, kind: str,
             group: int) -> torch.Tensor:
    k = q.shape[1]
    s = scales.float().repeat_interleave(group, dim=1)[:, :k]
    if kind == "int8":
        return q.float() * s
    m = (mins.float().repeat_interleave(group, dim=1)[:, :k] if mins is not None else -8.0 * s)
    return q.float() * s + m


def dequantize_packed(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                      group: int, dtype: torch.dtype) -> torch.Tensor:
    """A shard's stored tensors -> the weight in `dtype` (via float32): the reference."""
    int4 = qweight.dtype == torch.uint8
    q = unpack_int4(qweight) if int4 else qweight
    return _dequant(q, scales, mins, "int4" if int4 else "int8", group).to(dtype)


# ---- cutting a quantized weight into rank shards -----------------------------------------

def q_rows(t: QTensor, start: int, end: int) -> QTensor:
    return replace(t, q=t.q[start:end], scales=t.scales[start:end],
                   mins=None if t.mins is None else t.mins[start:end])


def q_cat_rows(ts: list[QTensor]) -> QTensor:
    first = ts[0]
    if any(t.group != first.group or t.q.shape[1] != first.q.shape[1] for t in ts):
        raise ValueError("quantized tensors concatenated along rows must share K and groups")
    mins = None if first.mins is None else torch.cat([t.mins for t in ts])  # type: ignore[misc]
    return replace(first, q=torch.cat([t.q for t in ts]), scales=torch.cat([t.scales for t in ts]),
                   mins=mins)


def q_pad_rows(t: QTensor, rows: int) -> QTensor:
    """Zero rows (scale 0 and min 0: weight exactly 0) up to `rows`."""
    missing = rows - t.q.shape[0]
    if missing == 0:
        return t
    z = lambda x: torch.cat((x, x.new_zeros((missing, *x.shape[1:]))))  # noqa: E731
    return replace(t, q=z(t.q), scales=z(t.scales), mins=None if t.mins is None else z(t.mins))


def q_pad_cols(t: QTensor, cols: int, what: str) -> QTensor:
    """Zero input columns up to `cols` (whole zero groups; per channel: the same group)."""
    n, k = t.q.shape
    missing = cols - k
    if missing == 0:
        return t
    q = torch.cat((t.q, t.q.new_zeros((n, missing))), dim=1)
    if t.spec.group_size == 0:
        return replace(t, q=q, group=cols)
    if k % t.group or missing % t.group:
        raise BuildError(
            f"{what}: {k} inputs padded to {cols} for the ranks do not fall on groups of "
            f"{t.group}", f"choose a --quant-group-size that divides {k} and {missing}")
    z = lambda x: torch.cat((x, x.new_zeros((n, missing // t.group))), dim=1)  # noqa: E731
    return replace(t, q=q, scales=z(t.scales), mins=None if t.mins is None else z(t.mins))


def q_cols(t: QTensor, start: int, end: int, what: str) -> QTensor:
    """Input columns [start, end): grouped, they must be whole groups (a short last one at K)."""
    q = t.q[:, start:end]
    if t.spec.group_size == 0:
        return replace(t, q=q, group=end - start)
    if start % t.group or (end % t.group and end != t.q.shape[1]):
        raise BuildError(f"{what}: inputs {start}..{end} do not fall on groups of {t.group}",
                         "choose a --quant-group-size that divides them")
    g0, g1 = start // t.group, -(-end // t.group)
    return replace(t, q=q, scales=t.scales[:, g0:g1],
                   mins=None if t.mins is None else t.mins[:, g0:g1])


def q_cat_cols(ts: list[QTensor]) -> QTensor:
    """Pieces of input columns side by side (q_cols' pieces: whole groups, or per channel
    the same row scales in each)."""
    first = ts[0]
    q = torch.cat([t.q for t in ts], dim=1)
    if first.spec.group_size == 0:
        return replace(first, q=q, group=q.shape[1])
    mins = None if first.mins is None else torch.cat([t.mins for t in ts], dim=1)  # type: ignore[misc]
    return replace(first, q=q, scales=torch.cat([t.scales for t in ts], dim=1), mins=mins)


def q_split_cols(t: QTensor, tp: int, rank: int, what: str) -> QTensor:
    """Rank `rank`'s slice of the input columns. A group never straddles two ranks: per
    channel, every rank keeps the row's scale for its part of the row; grouped, the split
    must fall on group boundaries, or the build is refused with the reason."""
    if tp == 1:  # no boundary to straddle: the whole row, a short last group included
        return t
    k = t.q.shape[1]
    local = k // tp
    q = t.q[:, rank * local:(rank + 1) * local]
    if t.spec.group_size == 0:
        return replace(t, q=q, group=local)
    if local % t.group:
        fits = [g for g in (128, 64, 32) if local % g == 0]
        remedy = (f"choose --quant-group-size {' or '.join(map(str, fits))}" if fits
                  else "choose another --tp, or --quant int8_wo")
        raise BuildError(
            f"{what}: its {k} inputs split {tp} ways give {local} per rank, which is not a "
            f"multiple of the group size {t.group}: a group would straddle two ranks", remedy)
    g0, g1 = rank * local // t.group, (rank + 1) * local // t.group
    return replace(t, q=q, scales=t.scales[:, g0:g1],
                   mins=None if t.mins is None else t.mins[:, g0:g1])


def check_packable(t: QTensor, what: str) -> None:
    """Every rank's piece must be whole runs of 32 for int4 (the packed layout)."""
    k = t.q.shape[1]
    if t.spec.kind == "int4" and k % PACK:
        raise BuildError(f"{what}: {k} inputs per rank are not a multiple of {PACK}, which "
                         "packed int4 weights need", "choose another --tp, or --quant int8_wo")


def runs_here(quant: Quantization, backend: str, device: str, has_kernels: bool,
              weight_layout: str = "rows") -> tuple[bool, str]:
    """Whether this runtime can run an engine quantized so (the serve `compatible` gate);
    (ok, evidence or reason). The CPU ISA the kernels were compiled for is checked with
    the engine's target (runtime/host.py)."""
    if not quant.enabled:
        return True, "none"
    if quant.scheme not in SCHEMES:
        return False, (f"the engine is quantized {quant.scheme}, which only TensorRT-LLM runs; "
                       f"this is a {backend} engine")
    if backend == "aoti" and device == "cpu":
        if not has_kernels:
            return False, (f"the engine is quantized ({quant.describe()}) but carries no "
                           "kernels library for its quantized linears")
        if weight_layout in QPANEL_LAYOUTS and quant.linear:  # contract/layout.py
            head = " and LM head" if weight_layout in QHEAD_LAYOUTS and quant.lm_head else ""
            return True, (f"{quant.describe()}; aotllm::linear_qpanel ({quant.linear.kind} "
                          f"pair panels{head})")
        return True, f"{quant.describe()}; aotllm::linear_{quant.linear.kind if quant.linear else ''}"
    return True, f"{quant.describe()}; dequantize + linear ({backend})"
