// Decode attention over a paged KV cache, one kernel (flash-decoding style).
//
// Each (sequence, KV head) reads its keys and values in place through the block table,
// block by block, with an online softmax in float32; the query heads that share the KV
// head (GQA) are processed together, so each key and value row is read once. Nothing is
// gathered or copied, and no [context]-sized intermediate is materialized: the tensor
// version (runtime/models/attention.py) gathers whole blocks, masks, and runs a softmax
// over every slot, which costs more than the model's GEMMs at small batch. A block's scores
// are taken four queries x two keys at a time (eight FMA chains: one dot product at a time
// waited on the FMA latency) and its values a pass of registers at a time (SmolLM2 shapes,
// batch 16, context 128, 30 layers, 2 threads: 10.6-11.0 -> 4.7-5.0 ms). On AVX512-BF16
// targets the scores of bf16 caches come from the keys as stored (`vdpbf16ps`): batch 16,
// context 176, 30 layers, 2 threads 3.1-3.3 -> 2.7-2.8 ms. Keys and values are widened in
// registers as they are read, each value row once for up to 4 queries (AVX2: 2), and the
// softmax's exp takes a vector of scores an instruction: a float32 copy of every block
// stored and re-read each row once more. Batch 16 (1), context 300, 30 layers, 2 threads,
// Intel Xeon with AMX: 5.2-5.5 -> 4.2-4.3 ms (0.53 -> 0.44-0.48); the AVX2 level forced
// there 7.8-8.3 -> 5.1-5.3 ms (0.72-0.75 -> 0.50-0.52). The pieces are attention_blocks.h's.
//
// Prompt chunks take the same path in tiles of 8 query rows (x the group's heads), each row
// causal to its own position, so a key block is read once per tile: one row per query
// read the whole prefix once per row (SmolLM2, a 128-token prompt, 30 layers: see
// prefill_kernel).
//
// `kv_live` says which rows each KV head attends (runtime/models/kv_heads.py). With TP,
// SmolLM2's 3 KV heads over 2 ranks are 4 slots: rank 0 holds heads 0 and 1, rank 1 heads 1
// and 2, and each attends head 1 for half the rows (the other's output there is zeros, and
// the o_proj all-reduce adds the two). A zero head (padding the plan cannot share) attends
// none. What a head does not attend is not read; its output is zeros.
//
// A row is chosen by its token's position, not by where it sits in the batch: the rank that
// attends a shared head for a token then does not depend on the step that computes it (a
// decode row, a prompt chunk's row, or a speculative verify row), so the o_proj all-reduce
// adds the same partial sums in the same order and a token's logits are bit for bit the same
// whichever way it was computed. By batch row, a verify step split a sequence's tokens over
// the ranks differently from plain decode, and greedy outputs flipped at near-ties (gaps of
// 0.004-0.006 nats, 2 of 8 prompts at TP=2).
//
// paged_decode_attention:
// q            [B, Hq, D]             the decode queries (one per sequence)
// k_cache      [NB, bs, Hk, D]        v_cache likewise; slot = block * bs + offset
// block_tables [B, M] int64           padded with any valid block id
// ctx_lens     [B] int64              keys visible to each query (>= 1)
// kv_live      [Hk, 3] int64 or none  (modulus, lo, hi): head h attends the query at position
//                                     p (here ctx_len - 1) when lo <= p % modulus < hi (none:
//                                     every query; a scalar n: heads 0 .. n - 1 every query,
//                                     the rest none)
// window       int                    a sliding layer's keys: [ctx_len - window, ctx_len)
//                                     (0: all); the blocks before it are not read
// returns      [B, Hq, D]             same dtype as q
// paged_prefill_attention:
// q            [P, Q, Hq, D]          P prompt chunks of Q query rows
// block_tables [P, M] int64
// q_pos        [P, Q] int64           each row's position: it sees keys 0 .. q_pos
//                                     (with a window: q_pos - window + 1 .. q_pos)
// kv_live                             as above, p the row's q_pos
// returns      [P, Q, Hq, D]
#include "aoti_shim.h"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "attention_blocks.h"

namespace {

constexpr int kMaxGroup = 16;  // query heads per KV head handled in one pass

using namespace aotllm::attn;  // NOLINT: the block-level pieces (attention_blocks.h)

// Which queries each KV head attends (kv_live): the one at position p when lo <= p % mod < hi.
struct HeadRows {
  std::vector<int64_t> mod, lo, hi;
  bool attends(int64_t h, int64_t p) const {
    const int64_t x = p % mod[h];
    return x >= lo[h] && x < hi[h];
  }
};

// Per-thread scratch of one work item: up to G queries against one KV head.
struct Scratch {
  std::vector<float> qf, acc, probs, m, l;
  std::vector<at::BFloat16> qb;  // the queries unscaled (bf16 caches: block_scores_bf16)
  float sc = 1.f;                // the scale qf carries and qb does not
  Scratch(int64_t G, int64_t D, int64_t bs, float scale)
      : qf((G + 3) / 4 * 4 * D, 0.f), acc(G * D), probs(G * bs), m(G), l(G),
        qb((G + 3) / 4 * 4 * D, at::BFloat16(0.f)), sc(scale) {}
};

// One work item: the G queries in s.qf (scaled; rows past G zero) against the keys and
// values of one (sequence, KV head), read in place block by block through `table`; query i
// sees the keys [0, lim[i]) (lim >= 1: causal within a prompt, the whole context when
// decoding), or with a sliding `window` only [lim[i] - window, lim[i]): blocks before every
// query's window are never read. Each key and value row is read once for all G queries and
// widened in registers; an online softmax keeps one rescale a block.
// -> s.acc [G, D], s.l [G] (unnormalized).
template <typename scalar_t>
void attend(Scratch& s, int64_t G, const int64_t* lim, const int64_t* table, int64_t nblocks,
            const scalar_t* kh, int64_t k_block, int64_t k_slot, const scalar_t* vh,
            int64_t v_block, int64_t v_slot, int64_t D, int64_t bs, int64_t window) {
  const int64_t gp = (G + 3) / 4 * 4;
  const int64_t ctx = std::min(*std::max_element(lim, lim + G), nblocks * bs);
  const int64_t from = window > 0 ? std::max<int64_t>(*std::min_element(lim, lim + G) - window, 0) : 0;
  for (int64_t i = 0; i < G; ++i) {
    s.m[i] = -std::numeric_limits<float>::infinity();
    s.l[i] = 0.f;
  }
  std::fill(s.acc.begin(), s.acc.begin() + G * D, 0.f);
  for (int64_t j = from / bs; j * bs < ctx; ++j) {
    const int64_t blk = table[j], first = j * bs;
    const int64_t n = std::min<int64_t>(bs, ctx - first);
    const scalar_t* kb = kh + blk * k_block;
    const scalar_t* vb = vh + blk * v_block;
    if ((j + 1) * bs < ctx) {  // the next block's rows, while this one is computed
      const int64_t nn = std::min<int64_t>(bs, ctx - (j + 1) * bs);
      prefetch_rows(kh + table[j + 1] * k_block, nn, k_slot, D * sizeof(scalar_t));
      prefetch_rows(vh + table[j + 1] * v_block, nn, v_slot, D * sizeof(scalar_t));
    }
    if constexpr (kBf16Scores && std::is_same_v<scalar_t, at::BFloat16>) {
      if (D % 32 == 0) {
        block_scores_bf16(s.qb.data(), kb, k_slot, n, G, gp, D, s.sc, s.probs.data(), bs);
      } else {
        block_scores(s.qf.data(), kb, k_slot, n, G, gp, D, s.probs.data(), bs);
      }
    } else {
      block_scores(s.qf.data(), kb, k_slot, n, G, gp, D, s.probs.data(), bs);
    }
    for (int64_t i = 0; i < G; ++i) {  // online softmax: rescale once per block
      float* pi = &s.probs[i * bs];
      // The keys of this block query i may see; none (a later query's block): no weight.
      const int64_t ni = std::clamp<int64_t>(lim[i] - first, 0, n);
      // and, in a sliding window, not the keys before it
      const int64_t a = window > 0 ? std::clamp<int64_t>(lim[i] - window - first, 0, ni) : 0;
      if (ni == a) {
        std::fill(pi, pi + n, 0.f);
        continue;
      }
      const float corr = block_softmax(pi, n, a, ni, s.m[i], s.l[i]);
      float* ai = &s.acc[i * D];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ai[d] *= corr;
    }
    block_values(s.probs.data(), vb, v_slot, n, G, D, s.acc.data(), bs);
  }
}

// Query row i of the work item into s: scaled in float32, and as given in bf16 (qb).
template <typename scalar_t>
inline void load_query(const scalar_t* src, Scratch& s, int64_t i, int64_t D) {
  for (int64_t d = 0; d < D; ++d) s.qf[i * D + d] = to_f(src[d]) * s.sc;
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) std::copy(src, src + D, &s.qb[i * D]);
}

template <typename scalar_t>
inline void store_output(const Scratch& s, int64_t i, int64_t D, scalar_t* dst) {
  const float inv = 1.f / s.l[i];
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(s.acc[i * D + d] * inv);
}

template <typename scalar_t>
void decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& ctx_lens, double scale,
                   const HeadRows& rows, int64_t window, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hk = k_cache.size(2), M = block_tables.size(1);
  const int64_t g = Hq / Hk;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = ctx_lens.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
    Scratch s(g, D, bs, sc);
    int64_t lim[kMaxGroup];
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / Hk, h = work % Hk;
      if (!rows.attends(h, cl[b] - 1)) {  // another rank's query, or padding: nothing to read
        std::fill(op + (b * Hq + h * g) * D, op + (b * Hq + (h + 1) * g) * D, scalar_t(0));
        continue;
      }
      for (int64_t i = 0; i < g; ++i) {  // the query heads that share KV head h (GQA)
        load_query(qp + (b * Hq + h * g + i) * D, s, i, D);
        lim[i] = cl[b];
      }
      attend(s, g, lim, bt + b * M, M, kp + h * k_cache.stride(2), k_cache.stride(0),
             k_cache.stride(1), vp + h * v_cache.stride(2), v_cache.stride(0),
             v_cache.stride(1), D, bs, window);
      for (int64_t i = 0; i < g; ++i) store_output(s, i, D, op + (b * Hq + h * g + i) * D);
    }
  });
}

// Prompt chunks: P sequences of Q query rows each (a shorter chunk repeats its last row),
// q_pos [P, Q] their positions. A work item is (sequence, KV head, a tile of kTileRows of
// the rows that head attends): the tile's rows x the group's heads go through `attend`
// together, so each key and value block is read once per tile rather than once per
// query row (the decode kernel with one row per query re-read the whole prefix for every
// row). A head shared with another rank tiles every other row, which keeps the causal
// work even between the two.
constexpr int64_t kTileRows = 8;

template <typename scalar_t>
void prefill_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& q_pos, double scale,
                    const HeadRows& rows, int64_t window, at::Tensor& out) {
  const int64_t P = q.size(0), Q = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t bs = k_cache.size(1), Hk = k_cache.size(2), M = block_tables.size(1);
  const int64_t g = Hq / Hk, tiles = (Q + kTileRows - 1) / kTileRows;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* pos = q_pos.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float sc = static_cast<float>(scale);
  // Each chunk's rows that each head attends, in order (every row, every other one by
  // position, or none); the rest are zeros. own[p * Hk + h].
  std::vector<std::vector<int64_t>> own(P * Hk);
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t h = 0; h < Hk; ++h) {
      for (int64_t r = 0; r < Q; ++r) {
        if (rows.attends(h, pos[p * Q + r])) {
          own[p * Hk + h].push_back(r);
        } else {
          scalar_t* o = op + ((p * Q + r) * Hq + h * g) * D;
          std::fill(o, o + g * D, scalar_t(0));
        }
      }
    }
  }

  at::parallel_for(0, P * Hk * tiles, 1, [&](int64_t begin, int64_t end) {
    Scratch s(kTileRows * g, D, bs, sc);
    std::vector<int64_t> lim(kTileRows * g);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t p = work / (Hk * tiles), h = work / tiles % Hk, t0 = work % tiles * kTileRows;
      const std::vector<int64_t>& mine = own[p * Hk + h];
      const int64_t n = static_cast<int64_t>(mine.size());
      if (t0 >= n) continue;  // fewer rows than tiles: nothing left for this one
      const int64_t nrows = std::min(kTileRows, n - t0), G = nrows * g;
      const int64_t* tile = mine.data() + t0;
      std::fill(s.qf.begin(), s.qf.end(), 0.f);
      for (int64_t r = 0; r < nrows; ++r) {
        for (int64_t i = 0; i < g; ++i) {
          load_query(qp + (((p * Q + tile[r]) * Hq) + h * g + i) * D, s, r * g + i, D);
          lim[r * g + i] = pos[p * Q + tile[r]] + 1;
        }
      }
      attend(s, G, lim.data(), bt + p * M, M, kp + h * k_cache.stride(2), k_cache.stride(0),
             k_cache.stride(1), vp + h * v_cache.stride(2), v_cache.stride(0),
             v_cache.stride(1), D, bs, window);
      for (int64_t r = 0; r < nrows; ++r) {
        for (int64_t i = 0; i < g; ++i) {
          store_output(s, r * g + i, D, op + (((p * Q + tile[r]) * Hq) + h * g + i) * D);
        }
      }
    }
  });
}

void check_caches(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                  const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, op, ": caches [NB, bs, Hk, D]");
  TORCH_CHECK(k_cache.size(3) == q.size(-1) && q.size(-2) % k_cache.size(2) == 0,
              op, ": head_dim or GQA grouping does not match");
  TORCH_CHECK(q.size(-2) / k_cache.size(2) <= kMaxGroup, op, ": group too large");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "caches: head_dim contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              op, ": q and caches must share a dtype");
}

// kv_live as a HeadRows: none -> every row of every head; a scalar n (engines of stop 29)
// -> heads 0 .. n - 1 every row, the rest none; else [Hk, 3] (modulus, lo, hi).
HeadRows head_rows(const std::optional<at::Tensor>& kv_live, int64_t Hk) {
  HeadRows r{std::vector<int64_t>(Hk, 1), std::vector<int64_t>(Hk, 0),
             std::vector<int64_t>(Hk, 1)};
  if (!kv_live.has_value()) return r;
  auto t = kv_live->to(at::kLong).contiguous();
  const int64_t* v = t.data_ptr<int64_t>();
  if (t.numel() == 1) {
    for (int64_t h = std::max<int64_t>(v[0], 0); h < Hk; ++h) r.hi[h] = 0;
    return r;
  }
  TORCH_CHECK(t.dim() == 2 && t.size(0) == Hk && t.size(1) == 3,
              "kv_live: [Hk, 3] (modulus, lo, hi) for the cache's ", Hk, " KV heads");
  for (int64_t h = 0; h < Hk; ++h) {
    TORCH_CHECK(v[3 * h] >= 1, "kv_live: a modulus of at least 1");
    r.mod[h] = v[3 * h];
    r.lo[h] = v[3 * h + 1];
    r.hi[h] = v[3 * h + 2];
  }
  return r;
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& q_pos, double scale,
                                   const std::optional<at::Tensor>& kv_live, int64_t window) {
  TORCH_CHECK(q.dim() == 4, "paged_prefill_attention: q [P, Q, Hq, D]");
  check_caches("paged_prefill_attention", q, k_cache, v_cache);
  TORCH_CHECK(q_pos.dim() == 2 && q_pos.size(0) == q.size(0) && q_pos.size(1) == q.size(1),
              "paged_prefill_attention: q_pos [P, Q]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0),
              "paged_prefill_attention: block_tables [P, M]");
  auto qc = q.contiguous();
  auto bt = block_tables.to(at::kLong).contiguous();
  auto qpos = q_pos.to(at::kLong).contiguous();
  const HeadRows rows = head_rows(kv_live, k_cache.size(2));
  auto out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "paged_prefill", [&] {
    prefill_kernel<scalar_t>(qc, k_cache, v_cache, bt, qpos, scale, rows, window, out);
  });
  return out;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& ctx_lens, double scale,
                                  const std::optional<at::Tensor>& kv_live, int64_t window) {
  TORCH_CHECK(q.dim() == 3, "paged_decode_attention: q [B, Hq, D]");
  check_caches("paged_decode_attention", q, k_cache, v_cache);
  auto qc = q.contiguous();
  auto bt = block_tables.to(at::kLong).contiguous();
  auto cl = ctx_lens.to(at::kLong).contiguous();
  const HeadRows rows = head_rows(kv_live, k_cache.size(2));
  auto out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(qc, k_cache, v_cache, bt, cl, scale, rows, window, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aotllm, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor ctx_lens, float scale, Tensor? kv_live=None, int window=0) -> Tensor");
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor q_pos, float scale, Tensor? kv_live=None, int window=0) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(aotllm, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}

AOTI_ENTRY_POINT aoti_torch_cpu_paged_decode_attention(AtenTensorHandle q, AtenTensorHandle k_cache,
                                                  AtenTensorHandle v_cache,
                                                  AtenTensorHandle block_tables,
                                                  AtenTensorHandle ctx_lens, double scale,
                                                  AtenTensorHandle* kv_live, int64_t window,
                                                  AtenTensorHandle* ret0) {
  using namespace aotllm::shim;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    out(paged_decode_attention(in(q), in(k_cache), in(v_cache), in(block_tables), in(ctx_lens),
                               scale, opt(kv_live), window), ret0);
  });
}

AOTI_ENTRY_POINT aoti_torch_cpu_paged_prefill_attention(AtenTensorHandle q, AtenTensorHandle k_cache,
                                                   AtenTensorHandle v_cache,
                                                   AtenTensorHandle block_tables,
                                                   AtenTensorHandle q_pos, double scale,
                                                   AtenTensorHandle* kv_live, int64_t window,
                                                   AtenTensorHandle* ret0) {
  using namespace aotllm::shim;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    out(paged_prefill_attention(in(q), in(k_cache), in(v_cache), in(block_tables), in(q_pos),
                                scale, opt(kv_live), window), ret0);
  });
}
