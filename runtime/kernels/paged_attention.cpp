// Decode attention over a paged KV cache, one kernel (flash-decoding style).
//
// Each (sequence, KV head) reads its keys and values in place through the block table,
// block by block, with an online softmax in float32; the query heads that share the KV
// head (GQA) are processed together, so each key and value row is read once. Nothing is
// gathered or copied, and no [context]-sized intermediate is materialized: the tensor
// version (runtime/models/attention.py) gathers whole blocks, masks, and runs a softmax
// over every slot, which costs more than the model's GEMMs at small batch. A block's keys
// and values are widened to float32 once; its scores are taken four queries x two keys at a
// time (eight FMA chains: one dot product at a time waited on the FMA latency) and its
// values 64 dimensions a pass in registers (SmolLM2 shapes, batch 16, context 128, 30
// layers, 2 threads: 10.6-11.0 -> 4.7-5.0 ms).
//
// Prompt chunks take the same path in tiles of 8 query rows (x the group's heads), each row
// causal to its own position, so a key block is widened once per tile: one row per query
// widened the whole prefix once per row (SmolLM2, a 128-token prompt, 30 layers: see
// prefill_kernel).
//
// paged_decode_attention:
// q            [B, Hq, D]             the decode queries (one per sequence)
// k_cache      [NB, bs, Hk, D]        v_cache likewise; slot = block * bs + offset
// block_tables [B, M] int64           padded with any valid block id
// ctx_lens     [B] int64              keys visible to each query (>= 1)
// returns      [B, Hq, D]             same dtype as q
// paged_prefill_attention:
// q            [P, Q, Hq, D]          P prompt chunks of Q query rows
// block_tables [P, M] int64
// q_pos        [P, Q] int64           each row's position: it sees keys 0 .. q_pos
// returns      [P, Q, Hq, D]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "tile_gemm.h"

namespace {

constexpr int kMaxGroup = 16;  // query heads per KV head handled in one pass

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// One cache row as float32: bf16 widened by a shift (vectorized), others converted.
template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = to_f(src[d]);
}
template <>
inline void widen(const at::BFloat16* src, float* dst, int64_t n) {
  aotllm::bf16_to_f32(reinterpret_cast<const uint16_t*>(src), dst, n);
}

// exp(x) for x <= 0 in a form the compiler vectorizes (std::exp is a scalar libm call, and
// a block's softmax calls it once per score): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2],
// p of degree 6 (relative error below 2e-7). Inputs under -87 return about 1e-38, not 0.
inline float exp_neg(float x) {
  x = std::max(x, -87.0f);
  const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest
  const float r = x - n * 0.693145752f - n * 1.42860677e-6f;
  float p = 1.38888889e-3f;
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, 4);
  return p * scale;
}

// Scores of one block: probs[i * bs + t] = q_i . k_t for the group's g queries (qf [gp, D],
// zero rows past g) and the block's n keys (kbuf [n, D], float32).
void block_scores(const float* qf, const float* kbuf, int64_t n, int64_t g, int64_t gp,
                  int64_t D, float* probs, int64_t bs) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    // Four queries x two keys a pass: eight independent FMA chains (one dot product a chain
    // waited on the FMA latency: most of the kernel's time before), reduced four at a time.
    const auto hsum4 = [](__m256 a, __m256 b, __m256 c, __m256 d) {
      const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
      return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
    };
    alignas(16) float s[2][4];
    for (int64_t i = 0; i < gp; i += 4) {
      const float* q0 = qf + i * D;
      const int64_t heads = std::min<int64_t>(4, g - i);
      for (int64_t t = 0; t < n; t += 2) {
        const float* k0 = kbuf + t * D;
        const float* k1 = t + 1 < n ? k0 + D : k0;  // an odd last key pairs with itself
        __m256 a[8];
        for (auto& v : a) v = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 x0 = _mm256_loadu_ps(k0 + d), x1 = _mm256_loadu_ps(k1 + d);
          for (int64_t j = 0; j < 4; ++j) {
            const __m256 qv = _mm256_loadu_ps(q0 + j * D + d);
            a[j] = _mm256_fmadd_ps(qv, x0, a[j]);
            a[4 + j] = _mm256_fmadd_ps(qv, x1, a[4 + j]);
          }
        }
        _mm_store_ps(s[0], hsum4(a[0], a[1], a[2], a[3]));
        _mm_store_ps(s[1], hsum4(a[4], a[5], a[6], a[7]));
        for (int64_t j = 0; j < heads; ++j) {
          probs[(i + j) * bs + t] = s[0][j];
          if (t + 1 < n) probs[(i + j) * bs + t + 1] = s[1][j];
        }
      }
    }
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    const float* kr = kbuf + t * D;
    for (int64_t i = 0; i < g; ++i) {
      const float* qi = qf + i * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qi[d] * kr[d];
      probs[i * bs + t] = s;
    }
  }
}

// acc_i += sum_t p_i[t] v_t for the group's g queries over the block's n values (vbuf
// [n, D], float32).
void block_values(const float* probs, const float* vbuf, int64_t n, int64_t g, int64_t D,
                  float* acc, int64_t bs) {
  for (int64_t i = 0; i < g; ++i) {
    const float* pi = probs + i * bs;
    float* ai = acc + i * D;
    int64_t d0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    // 64 dimensions a pass in eight registers, the keys' weights broadcast: eight chains.
    for (; d0 + 64 <= D; d0 += 64) {
      __m256 a[8];
      for (int64_t j = 0; j < 8; ++j) a[j] = _mm256_loadu_ps(ai + d0 + 8 * j);
      for (int64_t t = 0; t < n; ++t) {
        const __m256 p = _mm256_broadcast_ss(pi + t);
        const float* vr = vbuf + t * D + d0;
        for (int64_t j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * j), a[j]);
      }
      for (int64_t j = 0; j < 8; ++j) _mm256_storeu_ps(ai + d0 + 8 * j, a[j]);
    }
#endif
    for (int64_t t = 0; t < n; ++t) {  // what is left of D (all of it without AVX2)
      const float p = pi[t];
      const float* vr = vbuf + t * D;
#pragma omp simd
      for (int64_t d = d0; d < D; ++d) ai[d] += p * vr[d];
    }
  }
}

// Per-thread scratch of one work item: up to G queries against one KV head.
struct Scratch {
  std::vector<float> qf, acc, probs, kbuf, vbuf, m, l;
  Scratch(int64_t G, int64_t D, int64_t bs)
      : qf((G + 3) / 4 * 4 * D, 0.f), acc(G * D), probs(G * bs), kbuf(bs * D), vbuf(bs * D),
        m(G), l(G) {}
};

// One work item: the G queries in s.qf (scaled; rows past G zero) against the keys and
// values of one (sequence, KV head), read in place block by block through `table`; query i
// sees the keys [0, lim[i]) (lim >= 1: causal within a prompt, the whole context when
// decoding). Each block's keys and values are widened to float32 once for all G queries;
// an online softmax keeps one rescale a block. -> s.acc [G, D], s.l [G] (unnormalized).
template <typename scalar_t>
void attend(Scratch& s, int64_t G, const int64_t* lim, const int64_t* table, int64_t nblocks,
            const scalar_t* kh, int64_t k_block, int64_t k_slot, const scalar_t* vh,
            int64_t v_block, int64_t v_slot, int64_t D, int64_t bs) {
  const int64_t gp = (G + 3) / 4 * 4;
  const int64_t ctx = std::min(*std::max_element(lim, lim + G), nblocks * bs);
  for (int64_t i = 0; i < G; ++i) {
    s.m[i] = -std::numeric_limits<float>::infinity();
    s.l[i] = 0.f;
  }
  std::fill(s.acc.begin(), s.acc.begin() + G * D, 0.f);
  for (int64_t j = 0; j * bs < ctx; ++j) {
    const int64_t blk = table[j], first = j * bs;
    const int64_t n = std::min<int64_t>(bs, ctx - first);
    const scalar_t* kb = kh + blk * k_block;
    const scalar_t* vb = vh + blk * v_block;
    for (int64_t t = 0; t < n; ++t) widen(kb + t * k_slot, &s.kbuf[t * D], D);
    block_scores(s.qf.data(), s.kbuf.data(), n, G, gp, D, s.probs.data(), bs);
    for (int64_t i = 0; i < G; ++i) {  // online softmax: rescale once per block
      float* pi = &s.probs[i * bs];
      // The keys of this block query i may see; none (a later query's block): no weight.
      const int64_t ni = std::clamp<int64_t>(lim[i] - first, 0, n);
      if (ni == 0) {
        std::fill(pi, pi + n, 0.f);
        continue;
      }
      const float m_new = std::max(s.m[i], *std::max_element(pi, pi + ni));
      // ~0 on the first block (m = -inf), where acc and l are 0 anyway
      const float corr = exp_neg(s.m[i] - m_new);
      float lsum = 0.f;
#pragma omp simd reduction(+ : lsum)
      for (int64_t t = 0; t < ni; ++t) {
        pi[t] = exp_neg(pi[t] - m_new);
        lsum += pi[t];
      }
      std::fill(pi + ni, pi + n, 0.f);
      lsum += s.l[i] * corr;
      float* ai = &s.acc[i * D];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ai[d] *= corr;
      s.m[i] = m_new;
      s.l[i] = lsum;
    }
    for (int64_t t = 0; t < n; ++t) widen(vb + t * v_slot, &s.vbuf[t * D], D);
    block_values(s.probs.data(), s.vbuf.data(), n, G, D, s.acc.data(), bs);
  }
}

template <typename scalar_t>
inline void load_query(const scalar_t* src, float sc, int64_t D, float* dst) {
  for (int64_t d = 0; d < D; ++d) dst[d] = to_f(src[d]) * sc;
}

template <typename scalar_t>
inline void store_output(const Scratch& s, int64_t i, int64_t D, scalar_t* dst) {
  const float inv = 1.f / s.l[i];
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(s.acc[i * D + d] * inv);
}

template <typename scalar_t>
void decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& ctx_lens, double scale,
                   at::Tensor& out) {
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
    Scratch s(g, D, bs);
    int64_t lim[kMaxGroup];
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / Hk, h = work % Hk;
      for (int64_t i = 0; i < g; ++i) {  // the query heads that share KV head h (GQA)
        load_query(qp + (b * Hq + h * g + i) * D, sc, D, &s.qf[i * D]);
        lim[i] = cl[b];
      }
      attend(s, g, lim, bt + b * M, M, kp + h * k_cache.stride(2), k_cache.stride(0),
             k_cache.stride(1), vp + h * v_cache.stride(2), v_cache.stride(0),
             v_cache.stride(1), D, bs);
      for (int64_t i = 0; i < g; ++i) store_output(s, i, D, op + (b * Hq + h * g + i) * D);
    }
  });
}

// Prompt chunks: P sequences of Q query rows each (a shorter chunk repeats its last row),
// q_pos [P, Q] their positions. A work item is (sequence, KV head, a tile of kTileRows rows):
// the tile's rows x the group's heads go through `attend` together, so each key and value
// block is widened once per tile rather than once per query row (the decode kernel with
// one row per query re-read the whole prefix for every row).
constexpr int64_t kTileRows = 8;

template <typename scalar_t>
void prefill_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& q_pos, double scale,
                    at::Tensor& out) {
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

  at::parallel_for(0, P * Hk * tiles, 1, [&](int64_t begin, int64_t end) {
    Scratch s(kTileRows * g, D, bs);
    std::vector<int64_t> lim(kTileRows * g);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t p = work / (Hk * tiles), h = work / tiles % Hk, r0 = work % tiles * kTileRows;
      const int64_t rows = std::min(kTileRows, Q - r0), G = rows * g;
      std::fill(s.qf.begin(), s.qf.end(), 0.f);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < g; ++i) {
          load_query(qp + (((p * Q + r0 + r) * Hq) + h * g + i) * D, sc, D, &s.qf[(r * g + i) * D]);
          lim[r * g + i] = pos[p * Q + r0 + r] + 1;
        }
      }
      attend(s, G, lim.data(), bt + p * M, M, kp + h * k_cache.stride(2), k_cache.stride(0),
             k_cache.stride(1), vp + h * v_cache.stride(2), v_cache.stride(0),
             v_cache.stride(1), D, bs);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < g; ++i) {
          store_output(s, r * g + i, D, op + (((p * Q + r0 + r) * Hq) + h * g + i) * D);
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

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& q_pos, double scale) {
  TORCH_CHECK(q.dim() == 4, "paged_prefill_attention: q [P, Q, Hq, D]");
  check_caches("paged_prefill_attention", q, k_cache, v_cache);
  TORCH_CHECK(q_pos.dim() == 2 && q_pos.size(0) == q.size(0) && q_pos.size(1) == q.size(1),
              "paged_prefill_attention: q_pos [P, Q]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0),
              "paged_prefill_attention: block_tables [P, M]");
  auto qc = q.contiguous();
  auto bt = block_tables.to(at::kLong).contiguous();
  auto qpos = q_pos.to(at::kLong).contiguous();
  auto out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "paged_prefill", [&] {
    prefill_kernel<scalar_t>(qc, k_cache, v_cache, bt, qpos, scale, out);
  });
  return out;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& ctx_lens, double scale) {
  TORCH_CHECK(q.dim() == 3, "paged_decode_attention: q [B, Hq, D]");
  check_caches("paged_decode_attention", q, k_cache, v_cache);
  auto qc = q.contiguous();
  auto bt = block_tables.to(at::kLong).contiguous();
  auto cl = ctx_lens.to(at::kLong).contiguous();
  auto out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(qc, k_cache, v_cache, bt, cl, scale, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aotllm, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor ctx_lens, float scale) -> Tensor");
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor q_pos, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(aotllm, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
