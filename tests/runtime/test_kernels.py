"""Our compiled kernels (runtime/kernels/*.cpp) against their references, for real:
the library is compiled for this host as a build would, and the collectives run between
real processes over real shared memory."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.compile.kernels import build_kernels
from runtime import kernels
from runtime.core.plan import ScheduledSeq
from runtime.executors.runner import SeqState, prepare_inputs
from runtime.host import host_cpu_target
from runtime.models.attention import AttentionMetadata, decode_attention, paged_attention
from runtime.models.layers import VocabParallelEmbedding
from runtime.models.panels import pack_pairs, pack_panels, unpack_panels
from runtime.models.parallel import TPContext
from tests.conftest import REPO, subprocess_env


@pytest.fixture(scope="module")
def lib() -> Path:
    path = build_kernels(host_cpu_target())
    kernels.load(path)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# Head dims: 64 and 128 (whole 64-wide passes), 80 (a pass and a tail), 12 (no vector path);
# groups of 3 (padded to 4), 1, 8 (two passes of 4), 5.
@pytest.mark.parametrize(("hq", "hk", "d"), [(9, 3, 64), (4, 4, 16), (8, 1, 32), (6, 2, 128),
                                             (10, 2, 80), (2, 1, 12)])
def test_decode_attention_kernel_matches_the_tensor_reference(
        lib: Path, dtype: torch.dtype, hq: int, hk: int, d: int) -> None:
    torch.manual_seed(hq + d)
    nb, bs, b, m = 40, 16, 6, 5
    kc, vc = (torch.randn(nb, bs, hk, d).to(dtype) for _ in range(2))
    q = torch.randn(b, hq, d).to(dtype)
    tables = torch.randint(0, nb, (b, m))
    ctx = torch.tensor([1, 2, 15, 16, 17, m * bs])  # block edges, one key, a full table
    got = torch.ops.aotllm.paged_decode_attention(q, kc, vc, tables, ctx, d**-0.5)
    want = decode_attention(q.float(), kc.float(), vc.float(), tables, ctx, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float().reshape(b, hq * d), want, atol=tol, rtol=tol)


def test_padded_kv_heads_are_skipped_and_give_zeros(lib: Path) -> None:
    """kv_live: a rank's real KV heads; the padding's queries get zeros (attention to zero
    keys and values) without their cache being read, here filled with NaN to prove it."""
    torch.manual_seed(7)
    nb, bs, b, hq, hk, d = 12, 16, 3, 6, 2, 64
    kc, vc = (torch.randn(nb, bs, hk, d).to(torch.bfloat16) for _ in range(2))
    kc[:, :, 1], vc[:, :, 1] = float("nan"), float("nan")  # KV head 1: padding
    q = torch.randn(b, hq, d).to(torch.bfloat16)
    tables, ctx = torch.randint(0, nb, (b, 4)), torch.tensor([5, 16, 40])
    live = torch.tensor(1)
    got = torch.ops.aotllm.paged_decode_attention(q, kc, vc, tables, ctx, 0.125, live)
    want = torch.ops.aotllm.paged_decode_attention(q[:, :3], kc[:, :, :1], vc[:, :, :1], tables,
                                                   ctx, 0.125)
    assert torch.equal(got[:, :3], want) and torch.equal(got[:, 3:], torch.zeros_like(got[:, 3:]))
    qp, pos = torch.randn(2, 5, hq, d).to(torch.bfloat16), torch.tensor([[0, 1, 2, 3, 4], [9, 10, 11, 12, 13]])
    gotp = torch.ops.aotllm.paged_prefill_attention(qp, kc, vc, tables[:2], pos, 0.125, live)
    wantp = torch.ops.aotllm.paged_prefill_attention(qp[:, :, :3], kc[:, :, :1], vc[:, :, :1],
                                                     tables[:2], pos, 0.125)
    assert torch.equal(gotp[:, :, :3], wantp) and not gotp[:, :, 3:].any()


def test_a_shared_head_attends_its_positions_and_zeros_the_rest(lib: Path) -> None:
    """kv_live [Hk, 3] (runtime/models/kv_heads.py): head 0 every query, head 1 the queries
    at odd positions (the even ones are another rank's), head 2 none: its cache, NaN here,
    is never read. By the query's position (a decode query's is ctx_len - 1), not by its row
    in the batch or chunk: here the two differ in parity for some rows."""
    torch.manual_seed(8)
    nb, bs, b, hq, hk, d = 12, 16, 5, 6, 3, 64
    kc, vc = (torch.randn(nb, bs, hk, d).to(torch.bfloat16) for _ in range(2))
    kc[:, :, 2], vc[:, :, 2] = float("nan"), float("nan")
    rows = torch.tensor([[1, 0, 1], [2, 1, 2], [1, 0, 0]])
    q = torch.randn(b, hq, d).to(torch.bfloat16)
    tables, ctx = torch.randint(0, nb, (b, 4)), torch.tensor([5, 16, 40, 1, 64])
    got = torch.ops.aotllm.paged_decode_attention(q, kc, vc, tables, ctx, 0.125, rows)
    want = torch.ops.aotllm.paged_decode_attention(q[:, :4], kc[:, :, :2], vc[:, :, :2], tables,
                                                   ctx, 0.125)
    odd = (ctx - 1) % 2 == 1
    assert odd.tolist() == [False, True, True, False, True]  # rows 2 and 4: even rows, odd positions
    assert torch.equal(got[:, :2], want[:, :2]) and torch.equal(got[odd, 2:4], want[odd, 2:4])
    assert not got[~odd, 2:4].any() and not got[:, 4:].any()
    qp = torch.randn(2, 19, hq, d).to(torch.bfloat16)  # 10 odd rows: a tile of 8 and one of 2
    pos = torch.stack((torch.arange(19), torch.arange(19) + 31))  # chunk 1: odd rows at even positions
    gotp = torch.ops.aotllm.paged_prefill_attention(qp, kc, vc, tables[:2], pos, 0.125, rows)
    wantp = torch.ops.aotllm.paged_prefill_attention(qp[:, :, :4], kc[:, :, :2], vc[:, :, :2],
                                                     tables[:2], pos, 0.125)
    assert torch.equal(gotp[:, :, :2], wantp[:, :, :2])
    for c in range(2):
        oddp = pos[c] % 2 == 1
        assert torch.equal(gotp[c, oddp, 2:4], wantp[c, oddp, 2:4])
        assert not gotp[c, ~oddp, 2:4].any() and not gotp[c, :, 4:].any()


@pytest.mark.parametrize("kv_rows", [None, [[1, 0, 1], [2, 1, 2]], [[2, 0, 1], [1, 0, 0]]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_step_attends_the_same_with_the_kernel_as_with_tensor_operations(
        lib: Path, dtype: torch.dtype, kv_rows: list[list[int]] | None) -> None:
    """Decode rows and prefill chunks (one starting at 0, one after cached blocks, a
    one-token-short chunk padded) in one step: the kernel path, which runs prefill queries
    as rows of the decode kernel with their own causal lengths, equals the tensor path;
    with a head shared between ranks or a zero head too (kv_live: which rows each attends)."""
    torch.manual_seed(3)
    bs, hq, hk, d, nb = 4, 6, 2, 16, 64
    kc, vc = (torch.randn(nb, bs, hk, d).to(dtype) for _ in range(2))
    items, nxt = [], 1
    for i, (done, new) in enumerate([(9, 1), (0, 7), (8, 6), (3, 1), (4, 5)]):
        n = -(-(done + new) // bs)
        table = list(range(nxt, nxt + n))
        nxt += n
        items.append((SeqState([5] * (done + new), table), ScheduledSeq(i, done, new, [], True)))
    args, _ = prepare_inputs(items, bs)
    _, positions, slots, out_index, dq, dt, dc, pq, pt, _ = args
    meta = AttentionMetadata(slots, out_index, dq, dt, dc, pq, pt,
                             None if kv_rows is None else torch.tensor(kv_rows))
    q = torch.randn(positions.shape[0], hq, d).to(dtype)
    got = paged_attention(q, kc, vc, positions, meta, d**-0.5, use_kernels=True)
    want = paged_attention(q.float(), kc.float(), vc.float(), positions, meta, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8, 16, 67, 130])
@pytest.mark.parametrize(("n", "k", "bias"), [(960, 576, False), (70, 100, True), (33, 1536, True)])
def test_linear_kernel_matches_f_linear(lib: Path, dtype: torch.dtype, m: int, n: int, k: int,
                                        bias: bool) -> None:
    torch.manual_seed(m * n + k)
    x, w = torch.randn(m, k).to(dtype), (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    got = torch.ops.aotllm.linear(x, w, b)
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: one rounding of the output
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_panels_pack_and_unpack_exactly() -> None:
    for n in (16, 48, 37, 5):  # whole panels, and a short last one
        w = torch.arange(n * 7, dtype=torch.float32).view(n, 7)
        p = pack_panels(w)
        assert p.shape == w.shape and not torch.equal(p, w)
        torch.testing.assert_close(unpack_panels(p), w, atol=0, rtol=0)
    # panel 0's row k is columns 0..15 at input k: element [k][j] at k * 16 + j
    w = torch.randn(40, 9)
    assert torch.equal(pack_panels(w).reshape(-1)[3 * 16 + 5], w[5, 3])
    assert torch.equal(pack_panels(w).reshape(-1)[32 * 9 + 2 * 8 + 7], w[32 + 7, 2])  # nr = 8


@pytest.mark.parametrize(("fmt", "pack"), [("panels16", pack_panels), ("pairs16", pack_pairs)])
def test_an_embedding_tied_to_a_head_in_panels_gathers_the_same_rows(fmt: str, pack) -> None:
    vocab, hidden = 64, 32
    w = torch.randn(vocab, hidden)
    emb = VocabParallelEmbedding(vocab, hidden, TPContext(), torch.float32, panels=fmt)
    emb.weight = torch.nn.Parameter(pack(w), requires_grad=False)
    ids = torch.tensor([0, 15, 16, 17, 63, 5, 5])
    assert torch.equal(emb(ids), torch.nn.functional.embedding(ids, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 16, 67])
@pytest.mark.parametrize(("n", "k", "bias"), [(960, 576, False), (70, 100, True), (40, 1536, True),
                                              (5, 3, False)])
def test_panel_linear_kernel_matches_f_linear(lib: Path, dtype: torch.dtype, m: int, n: int,
                                              k: int, bias: bool) -> None:
    """Weights packed in panels of 16 columns (n % 16 != 0: a short last panel; n < 16:
    only that), 1-16 rows (decode) and more (prefill), against F.linear on the same numbers."""
    torch.manual_seed(m * n + k)
    x, w = torch.randn(m, k).to(dtype), (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    got = torch.ops.aotllm.linear_panel(x, pack_panels(w), b)
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # 16-bit: one rounding of the output
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    # a leading batch dimension is kept, as at::linear keeps it
    got3 = torch.ops.aotllm.linear_panel(x.view(1, m, k), pack_panels(w), b)
    assert got3.shape == (1, m, n) and torch.equal(got3[0], got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [960, 200, 4104])
def test_a_row_gets_the_same_bits_beside_any_other_rows(lib: Path, dtype: torch.dtype,
                                                        n: int) -> None:
    """A few rows take several panels a pass (panel_group), more rows one panel a pass, and a
    chunk's or the weight's last panels go one at a time: a row's outputs must be the same
    bits whichever way it went and whatever rows ran beside it, or a sequence's tokens would
    change with the server's load."""
    torch.manual_seed(n)
    k = 576
    x, w = torch.randn(20, k).to(dtype), pack_panels((torch.randn(n, k) / k**0.5).to(dtype))
    b = torch.randn(n).to(dtype)
    for float_out in (False, True):
        alone = torch.cat([torch.ops.aotllm.linear_panel(x[i : i + 1], w, b, float_out)
                           for i in range(len(x))])
        for m in (2, 3, 4, 5, 8, 16, 20):
            assert torch.equal(torch.ops.aotllm.linear_panel(x[:m], w, b, float_out), alone[:m])


def _bf16_bits_as_c10_casts(v: torch.Tensor) -> torch.Tensor:
    """c10::BFloat16(float) bit for bit: round to nearest even on the bits, NaN as 0x7FC0
    (torch's vectorized .bfloat16() may give other NaN bits, or flush denormals)."""
    u = v.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return torch.where(torch.isnan(v), torch.full_like(r, 0x7FC0), r)


# Outputs whose float32 sums are exactly the bias: ties to even up and down, denormals, signed
# zeros, infinities, NaN, a float32 above bf16's largest (rounds to inf), ordinary values.
_ROUNDING_CASES = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1e-40, -3e-39, -0.0, 0.0,
                   float("inf"), float("-inf"), float("nan"), 3.4e38, 1 / 3, -2.7182817,
                   65504.5, 1e-20, 7.0]


@pytest.mark.parametrize("m", [1, 3, 16, 20])
def test_panel_outputs_round_as_the_scalar_cast(lib: Path, m: int) -> None:
    """The kernel stores its sums 16 lanes at a time: bf16 outputs must carry the bits a scalar
    c10 cast gives, float32 ones the sums themselves."""
    k, n = 32, 2 * len(_ROUNDING_CASES)
    bias = torch.tensor(_ROUNDING_CASES * 2, dtype=torch.float32)
    x, w = torch.zeros(m, k, dtype=torch.bfloat16), torch.zeros(n, k, dtype=torch.bfloat16)
    want = torch.zeros(m, n) + bias  # the sums are +0: -0.0 + 0 comes out +0, as in the kernel
    got = torch.ops.aotllm.linear_panel(x, pack_panels(w), bias)
    got_bits = got.view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(got_bits, _bf16_bits_as_c10_casts(want))
    got32 = torch.ops.aotllm.linear_panel(x, pack_panels(w), bias, True)
    assert torch.equal(got32.view(torch.int32), want.view(torch.int32))


def _run_ranks(lib: Path, size: int, mode: str, tmp: Path) -> list[subprocess.CompletedProcess[str]]:
    name = f"/aotllm-test-{secrets.token_hex(4)}"
    out = tmp / "out.json"
    procs = []
    for rank in range(size):
        cmd = [sys.executable, "-m", "tests.runtime.shm_worker", str(lib), name, str(rank),
               str(size), mode, str(out)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        if rank == 0:
            time.sleep(1.0)  # rank 0 creates the segment the others attach to
    try:
        done = [p.communicate(timeout=120) for p in procs]
    finally:
        torch.ops.aotllm.shm_unlink(name)
    return [subprocess.CompletedProcess(p.args, p.returncode, o, e)
            for p, (o, e) in zip(procs, done)]


@pytest.mark.parametrize("size", [2, 3])
def test_shared_memory_collectives_sum_and_gather_like_the_definition(
        lib: Path, size: int, tmp_path: Path) -> None:
    runs = _run_ranks(lib, size, "ok", tmp_path)
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    results = [json.loads((tmp_path / f"out.json.{r}").read_text()) for r in range(size)]
    for dtype in (torch.float32, torch.bfloat16):
        xs = [(torch.arange(1000, dtype=torch.float32) * (r + 1) / 7).to(dtype).float()
              for r in range(size)]
        want = torch.stack(xs).sum(0).to(dtype).float()
        for res in results:
            got = res[str(dtype)]
            for reduced in got["reduced"]:  # every call, every rank: bitwise the same
                assert reduced == results[0][str(dtype)]["reduced"][0]
            torch.testing.assert_close(torch.tensor(got["reduced"][0]), want, atol=0, rtol=1e-2)
            assert got["gathered"] == torch.cat([x.view(10, 100) for x in xs]).tolist()
    print(f"all_reduce of one 576-wide bf16 row: {results[0]['us_per_all_reduce']:.1f} us")


def test_a_dead_peer_is_an_error_not_a_hang(lib: Path, tmp_path: Path) -> None:
    t0 = time.monotonic()
    runs = _run_ranks(lib, 2, "die", tmp_path)
    assert runs[1].returncode == 0
    assert runs[0].returncode != 0 and "is gone" in runs[0].stderr, runs[0].stderr[-2000:]
    assert time.monotonic() - t0 < 30
    assert not os.path.exists(tmp_path / "out.json.0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Rows: one, a short tile, a whole tile, a tile and one, several tiles; groups as above.
@pytest.mark.parametrize(("hq", "hk", "d"), [(9, 3, 64), (8, 1, 32), (10, 2, 80), (2, 1, 12)])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 21])
def test_prefill_attention_kernel_matches_each_row_as_a_decode_query(
        lib: Path, dtype: torch.dtype, hq: int, hk: int, d: int, rows: int) -> None:
    """Each prompt row attends to the keys up to its own position, whatever tile it is in:
    the same as the decode kernel (itself checked against the tensor path above) given
    that row alone with its causal length. Chunks start at 0, mid-block and after blocks."""
    torch.manual_seed(hq * rows + d)
    nb, bs, m = 64, 16, 4
    kc, vc = (torch.randn(nb, bs, hk, d).to(dtype) for _ in range(2))
    starts = torch.tensor([0, 5, 40])[:, None]  # [P, 1]
    pos = starts + torch.arange(rows)[None, :]  # [P, Q]
    pos[2, -3:] = pos[2, -4] if rows > 4 else pos[2]  # a short chunk repeats its last row
    tables = torch.randperm(nb)[: 3 * m].view(3, m)
    q = torch.randn(3, rows, hq, d).to(dtype)
    got = torch.ops.aotllm.paged_prefill_attention(q, kc, vc, tables, pos, d**-0.5)
    want = torch.ops.aotllm.paged_decode_attention(
        q.reshape(3 * rows, hq, d), kc, vc, tables.repeat_interleave(rows, 0),
        (pos + 1).reshape(-1), d**-0.5).reshape(3, rows, hq, d)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_prefill_attention_rejects_mismatched_positions(lib: Path) -> None:
    kc = vc = torch.zeros(4, 16, 1, 8)
    with pytest.raises(RuntimeError, match="q_pos"):
        torch.ops.aotllm.paged_prefill_attention(torch.zeros(1, 3, 2, 8), kc, vc,
                                                 torch.zeros(1, 1, dtype=torch.long),
                                                 torch.zeros(1, 2, dtype=torch.long), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sliding_window_is_honoured_and_the_blocks_before_it_are_not_read(
        lib: Path, dtype: torch.dtype) -> None:
    """window: a query at position p sees keys p - window < k <= p (decode: p = ctx - 1);
    the blocks before every query's window are NaN here, so reading one would show."""
    torch.manual_seed(11)
    nb, bs, hq, hk, d, window = 20, 4, 4, 1, 32, 6
    kc, vc = (torch.randn(nb, bs, hk, d).to(dtype) for _ in range(2))
    tables = torch.arange(1, 9).view(1, 8).repeat(2, 1)  # keys 0 .. 31 in blocks 1 .. 8
    tables[1] = torch.arange(11, 19)
    for blk in (1, 2, 11, 12, 13):  # before every window below (ctx 17, 25; rows from 14)
        kc[blk], vc[blk] = float("nan"), float("nan")
    q, ctx = torch.randn(2, hq, d).to(dtype), torch.tensor([17, 25])
    got = torch.ops.aotllm.paged_decode_attention(q, kc, vc, tables, ctx, 0.2, None, window)
    want = decode_attention(q.float(), kc.float().nan_to_num(), vc.float().nan_to_num(), tables,
                            ctx, 0.2, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().reshape(2, hq * d), want, atol=tol, rtol=tol)
    pos = torch.tensor([[14, 15, 16, 17, 18, 19, 20, 21, 22], [22, 23, 24, 25, 26, 27, 28, 29, 30]])
    qp = torch.randn(2, 9, hq, d).to(dtype)
    gotp = torch.ops.aotllm.paged_prefill_attention(qp, kc, vc, tables, pos, 0.2, None, window)
    for p in range(2):
        for r in range(9):
            want = decode_attention(qp[p, r:r + 1].float(), kc.float().nan_to_num(),
                                    vc.float().nan_to_num(), tables[p:p + 1], pos[p, r:r + 1] + 1,
                                    0.2, window)
            torch.testing.assert_close(gotp[p, r].float().reshape(1, hq * d), want, atol=tol, rtol=tol)


def test_a_failed_kernel_compile_names_the_error_not_the_warnings(tmp_path: Path) -> None:
    # A real g++ run over torch's headers (pages of warnings at -std=c++17) and one broken line.
    from torch.utils import cpp_extension

    from contract.target import Target
    from pipeline.compile.kernels import _compiler, compile_flags, compiler_errors

    src = tmp_path / "broken.cpp"
    src.write_text("#include <ATen/ATen.h>\nint f() { return undeclared_name_here; }\n")
    flags = [f for f in compile_flags(Target(device="cpu", arch="x86_64", isa="avx2"))
             if f != "-shared"]
    proc = subprocess.run([_compiler(), *flags, "-Wall", "-c", str(src), "-o",
                           str(tmp_path / "broken.o")], capture_output=True, text=True)
    assert proc.returncode != 0 and cpp_extension.include_paths()
    said = compiler_errors(proc.stderr)
    assert "undeclared_name_here" in said and "error" in said and len(said) <= 1500
    assert compiler_errors("ld: cannot find -lfoo\ncollect2: error: ld returned 1") == (
        "collect2: error: ld returned 1")
    assert compiler_errors("no marker at all " * 200).endswith("no marker at all")
