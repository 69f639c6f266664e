// Block-KV attention on the CPU, its caches in float32, bfloat16 or float16, computed in float32: the contract of block_kv_torch.block_kv_attention for
// every step nb runs (decode rows, speculative rows, packed prefill chunks), reading each cached K
// and V vector in place through the block table. block_kv_cpu.py defines the op's schema, builds
// this file and documents why it exists.
//
// The step's segments become tasks, shared out among the threads by their cost (longest first, each
// to the least loaded thread):
// - A short segment (decode, drafts: at most kShortTokens) is one task per step row's kv heads, or
//   per kv head when there are fewer segments than threads. Every query of the segment (its tokens
//   times the task's heads) meets each key as it is loaded; an online softmax runs block by block
//   over the context, then over the segment's own tokens. This is bound by memory.
// - A long segment (a prompt chunk) is one task per kv head and tile of its queries. The tile's
//   queries of that kv head's query heads are stacked into one matrix, and an online softmax runs
//   over chunks of keys: the context's (gathered from the blocks) and the segment's own (in place),
//   each chunk's scores and weighted values one BLAS GEMM, so the work runs near the GEMM rate.
//   Keys past the tile's last token, or outside a sliding window, are never computed.
// Positions at or past a context's length are never read, so whatever the cache holds there (the
// null block, stale or NaN data) cannot reach an output. A query that sees no key gets zeros.
// Half-precision caches are read in place and widened to float32 as they are read (a block of a
// short segment, a gathered chunk of a long one), so every product and sum runs in float32; the
// step's own queries, keys and values are widened once on entry, and the output rounded once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

// The BLAS torch links (MKL in its x86 wheels), through its Fortran interface.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kShortTokens = 16;  // segments up to this long take the per-key path
constexpr int64_t kTileRows = 192;    // stacked query rows of a long segment's tile (tokens x group)
constexpr int64_t kChunk = 256;       // keys per GEMM chunk of a long segment
constexpr int64_t kFoldKeys = 64;     // context keys a short segment's softmax folds at once

// Row-major c (m x n, ldc) = a (m x k) . b^T for b (n x k): BLAS is column-major, so this is
// c^T = b . a^T there.
inline void gemm_nt(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc) {
  const char ta = 'T', tb = 'N';
  const float one = 1.f, zero = 0.f;
  sgemm_(&ta, &tb, &n, &m, &k, &one, b, &ldb, a, &lda, &zero, c, &ldc);
}

// Row-major c (m x n, ldc) += a (m x k) . b for b (k x n).
inline void gemm_nn_add(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc) {
  const char t = 'N';
  const float one = 1.f;
  sgemm_(&t, &t, &n, &m, &k, &one, b, &ldb, a, &lda, &one, c, &ldc);
}

// dst[0:n] = src[0:n] widened to float32 (a copy for float32 itself).
template <typename C>
inline void to_float(const C* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<C, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    using Half = at::vec::Vectorized<C>;  // twice as many lanes as a float32 register
    int64_t i = 0;
    for (; i + Half::size() <= n; i += Half::size()) {
      auto [lo, hi] = at::vec::convert_to_float<C>(Half::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + Vec::size());
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size())
    acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {  // y += a * x
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size())
    at::vec::fmadd(Vec(a), Vec::loadu(x + d), Vec::loadu(y + d)).store(y + d);
  for (; d < n; ++d) y[d] += a * x[d];
}

inline void scale_by(float* y, float a, int64_t n) {  // y *= a
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) (Vec::loadu(y + d) * Vec(a)).store(y + d);
  for (; d < n; ++d) y[d] *= a;
}

inline float max_of(const float* s, int64_t n) {
  Vec top(kNegInf);
  for (int64_t t = 0; t < n; t += Vec::size()) {
    const int64_t count = std::min<int64_t>(Vec::size(), n - t);
    top = at::vec::maximum(top, Vec::set(Vec(kNegInf), Vec::loadu(s + t, count), count));
  }
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, top);
}

// s = exp(s - top) in place; returns the sum. exp(-inf) is 0: invisible keys weigh nothing.
inline float exp_sum(float* s, float top, int64_t n) {
  Vec total(0.f);
  for (int64_t t = 0; t < n; t += Vec::size()) {
    const int64_t count = std::min<int64_t>(Vec::size(), n - t);
    Vec p = (Vec::loadu(s + t, count) - Vec(top)).exp_u20();
    p.store(s + t, count);
    total = total + Vec::set(Vec(0.f), p, count);
  }
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, total);
}

// dst (n x m, leading dimension ld_dst) = the transpose of src (m x n), m, n <= Vec::size().
inline void transpose(const float* src, int64_t ld_src, float* dst, int64_t ld_dst, int m, int n) {
#if defined(CPU_CAPABILITY_AVX2)
  if (m == 8 && n == 8) return at::vec::transpose_mxn<float, 8, 8>(src, ld_src, dst, ld_dst);
#endif
  at::vec::transpose_mxn<float>(src, ld_src, dst, ld_dst, m, n);  // AVX-512: masked, any m, n
}

// out[t] = scale * <query, key t> for the m keys whose transpose is kt (dim x Vec::size()): one
// broadcast multiply-add per dimension, four chains in flight, no reduction across the register.
inline void scores_of(const float* query, const float* kt, int64_t dim, float scale, float* out, int64_t m) {
  Vec acc[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
  int64_t d = 0;
  for (; d + 4 <= dim; d += 4)
    for (int k = 0; k < 4; ++k)
      acc[k] = at::vec::fmadd(Vec(query[d + k]), Vec::loadu(kt + (d + k) * Vec::size()), acc[k]);
  for (; d < dim; ++d) acc[0] = at::vec::fmadd(Vec(query[d]), Vec::loadu(kt + d * Vec::size()), acc[0]);
  (((acc[0] + acc[1]) + (acc[2] + acc[3])) * Vec(scale)).store(out, m);
}

// a += sum over t < n of p[t] * values[t][offset:], four registers of ``a`` at a time held across
// the keys (not stored and reloaded per key).
inline void accumulate(float* a, const float* p, const std::vector<const float*>& values, int64_t offset,
                       int64_t n, int64_t dim) {
  constexpr int64_t kRegs = 4;
  for (int64_t d0 = 0; d0 < dim; d0 += kRegs * Vec::size()) {
    const int64_t width = std::min<int64_t>(kRegs * Vec::size(), dim - d0);
    if (width < kRegs * Vec::size()) {  // a tail narrower than four registers
      for (int64_t t = 0; t < n; ++t) axpy(a + d0, p[t], values[t] + offset + d0, width);
      continue;
    }
    Vec r[kRegs];
    for (int64_t k = 0; k < kRegs; ++k) r[k] = Vec::loadu(a + d0 + k * Vec::size());
    for (int64_t t = 0; t < n; ++t) {
      const Vec w(p[t]);
      const float* v = values[t] + offset + d0;
      for (int64_t k = 0; k < kRegs; ++k) r[k] = at::vec::fmadd(w, Vec::loadu(v + k * Vec::size()), r[k]);
    }
    for (int64_t k = 0; k < kRegs; ++k) r[k].store(a + d0 + k * Vec::size());
  }
}

// The running softmax of a set of queries: top score, total weight and weighted values of each.
struct Softmax {
  int64_t dim = 0;
  std::vector<float> top, total, acc;  // (Q), (Q), (Q, D)

  void reset(int64_t q, int64_t d) {
    dim = d;
    top.assign(q, kNegInf), total.assign(q, 0.f), acc.assign(q * d, 0.f);
  }

  // Turn query i's scores s[0:n] into weights against its new top score and rescale what it has
  // so far; returns false (weights untouched) when none of them is visible (all -inf).
  bool fold(int64_t i, float* s, int64_t n) {
    const float block_top = max_of(s, n);  // -inf when n is 0
    if (block_top == kNegInf) return false;
    const float new_top = std::max(top[i], block_top);
    const float rescale = std::exp(top[i] - new_top);  // exp(-inf) = 0 on the first visible block
    if (rescale != 1.f) scale_by(acc.data() + i * dim, rescale, dim);
    total[i] = total[i] * rescale + exp_sum(s, new_top, n);
    top[i] = new_top;
    return true;
  }

  // Query i's output: its weighted values over its total weight (zeros when it saw no key).
  void write(int64_t i, float* out) const {
    const float* a = acc.data() + i * dim;
    const float inv = total[i] > 0.f ? 1.f / total[i] : 0.f;
    for (int64_t d = 0; d < dim; ++d) out[d] = a[d] * inv;
  }
};

// A run of one segment's tokens, for some kv heads and a range of its tokens.
struct Task {
  int64_t b, s0, tokens;  // step row, first token of the segment, its length
  int64_t row, context;   // block-table row it continues (-1: none) and its cached length
  int64_t h0, h1;         // kv heads
  int64_t a, e;           // the segment's tokens a .. e - 1 (long segments: one query tile)
  double cost;
};

struct Scratch {  // one thread's buffers
  Softmax sm;
  std::vector<float> scores, queries, keys, values, kt, block_k, block_v;
  std::vector<const float*> rows;
};

// C: the caches' element type; the step's tensors and the output are float32 here.
template <typename C>
struct Attention {
  static constexpr bool kWide = std::is_same_v<C, float>;  // read the cache in place, no widening
  const float *q, *k_own, *v_own;
  const C *k_cache, *v_cache;
  const int64_t *table, *lens, *segments;
  float* out;
  int64_t batch, seq, heads, dim, kv_heads, group, block, rows, cols;
  int64_t q_row, q_tok, k_row, k_tok, v_row, v_tok;  // strides of the step rows and tokens
  float scale;
  std::optional<int64_t> window;
  bool packed;

  const float* q_at(int64_t b, int64_t s) const { return q + b * q_row + s * q_tok; }
  const float* k_at(int64_t b, int64_t s) const { return k_own + b * k_row + s * k_tok; }
  const float* v_at(int64_t b, int64_t s) const { return v_own + b * v_row + s * v_tok; }
  float* out_at(int64_t b, int64_t s) const { return out + (b * seq + s) * heads * dim; }
  int64_t slot(int64_t row, int64_t position) const {  // a context position's slot in the caches
    return std::max<int64_t>(table[row * cols + position / block], 0) * block + position % block;
  }
  // The lowest position token u of a segment over ``context`` sees.
  int64_t first_seen(int64_t context, int64_t u) const {
    return window ? std::max<int64_t>(0, context + u - *window + 1) : 0;
  }

  std::vector<Task> tasks(int threads) const;
  void run_short(const Task& t, Scratch& w) const;
  void run_long(const Task& t, Scratch& w) const;
};

template <typename C>
std::vector<Task> Attention<C>::tasks(int threads) const {
  std::vector<Task> runs;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t* seg = segments + b * seq;
    for (int64_t s0 = 0; s0 < seq;) {
      int64_t s1 = s0 + 1;
      while (s1 < seq && seg[s1] == seg[s0]) ++s1;
      const int64_t g = seg[s0];
      const int64_t row = packed ? (g >= 0 && g < rows ? g : -1) : (g == 0 ? b : -1);
      const int64_t context = row < 0 ? 0 : std::clamp<int64_t>(lens[row], 0, cols * block);
      runs.push_back({b, s0, s1 - s0, row, context, 0, kv_heads, 0, s1 - s0, 0.});
      s0 = s1;
    }
  }
  std::vector<Task> out;
  int64_t short_count = 0;
  for (const Task& t : runs) short_count += t.tokens <= kShortTokens;
  // Short segments split by kv head only when they are too few to keep every thread busy: a task
  // with all heads reads each slot's K/V row whole and in order.
  const int64_t splits = short_count >= threads ? 1 : kv_heads;
  const int64_t tile = std::max<int64_t>(8, kTileRows / group);
  for (const Task& t : runs) {
    if (t.tokens <= kShortTokens) {
      for (int64_t part = 0; part < splits; ++part) {
        Task s = t;
        s.h0 = part * kv_heads / splits, s.h1 = (part + 1) * kv_heads / splits;
        s.cost = double(s.h1 - s.h0) * (t.context + t.tokens) * (64 + t.tokens * group);
        out.push_back(s);
      }
      continue;
    }
    for (int64_t kh = 0; kh < kv_heads; ++kh)
      for (int64_t a = 0; a < t.tokens; a += tile) {
        Task s = t;
        s.h0 = kh, s.h1 = kh + 1, s.a = a, s.e = std::min(t.tokens, a + tile);
        const int64_t first = first_seen(t.context, a);  // keys from here to the tile's last token
        s.cost = double(s.e - a) * group * (t.context + s.e - first + 64);
        out.push_back(s);
      }
  }
  return out;
}

template <typename C>
void Attention<C>::run_short(const Task& t, Scratch& w) const {
  const int64_t span = (t.h1 - t.h0) * group, queries = t.tokens * span;  // query heads, queries
  const int64_t key_stride = kv_heads * dim;  // between slots of a block
  // query i = (token s0 + i / span, head h0 * group + i % span), reading kv head offsets[i] / dim;
  // token s sits at position context + (s - s0), so with a window W it sees the positions above
  // that minus W.
  std::vector<int64_t> offsets(queries);
  std::vector<const float*> query(queries);
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t head = t.h0 * group + i % span;
    offsets[i] = head / group * dim;
    query[i] = q_at(t.b, t.s0 + i / span) + head * dim;
  }
  auto sees = [&](int64_t i, int64_t position) { return !window || t.context + i / span - position < *window; };
  // Several blocks' keys are scored before the softmax folds them: a fold per block of 16 rescaled
  // every query's sums and reduced across registers about as often as it scored keys.
  const int64_t fold = std::max<int64_t>(1, kFoldKeys / block) * block;
  const int64_t stride = std::max(fold, t.tokens);
  w.scores.resize(queries * stride);
  w.rows.resize(stride);
  w.kt.resize(((dim + Vec::size() - 1) / Vec::size()) * Vec::size() * Vec::size());
  w.sm.reset(queries, dim);
  if constexpr (!kWide) w.block_k.resize(fold * key_stride), w.block_v.resize(fold * key_stride);
  auto update = [&](int64_t n) {  // fold n keys whose values are w.rows into every query
    for (int64_t i = 0; i < queries; ++i) {
      float* s = w.scores.data() + i * stride;
      if (w.sm.fold(i, s, n)) accumulate(w.sm.acc.data() + i * dim, s, w.rows, offsets[i], n, dim);
    }
  };
  const int64_t first = first_seen(t.context, 0);
  int64_t held = 0;  // keys scored and not folded yet: columns 0 .. held - 1
  for (int64_t j = first / block; j * block < t.context; ++j) {
    const int64_t n = std::min(block, t.context - j * block);
    const int64_t base = slot(t.row, j * block) * key_stride;
    if ((j + 1) * block < t.context) {  // the next block's K and V, while this one is computed
      const int64_t next = slot(t.row, (j + 1) * block) * key_stride;
      for (int64_t x = 0; x < block * key_stride; x += 64 / sizeof(C)) {
        __builtin_prefetch(k_cache + next + x);
        __builtin_prefetch(v_cache + next + x);
      }
    }
    // The block's first slot of K and V, slots key_stride apart: in place, or widened (the task's
    // kv heads of the n slots in context only).
    const float *k_block, *v_block;
    if constexpr (kWide) {
      k_block = k_cache + base, v_block = v_cache + base;
    } else {
      const int64_t from = t.h0 * dim, width = (t.h1 - t.h0) * dim;
      float *k_wide = w.block_k.data() + held * key_stride, *v_wide = w.block_v.data() + held * key_stride;
      for (int64_t u = 0; u < n; ++u) {
        to_float(k_cache + base + u * key_stride + from, k_wide + u * key_stride + from, width);
        to_float(v_cache + base + u * key_stride + from, v_wide + u * key_stride + from, width);
      }
      k_block = k_wide, v_block = v_wide;
    }
    for (int64_t u = 0; u < n; ++u) w.rows[held + u] = v_block + u * key_stride;
    for (int64_t t0 = 0; t0 < n; t0 += Vec::size()) {  // Vec::size() slots at a time
      const int m = static_cast<int>(std::min<int64_t>(Vec::size(), n - t0));
      for (int64_t kh = t.h0; kh < t.h1; ++kh) {
        const float* keys = k_block + t0 * key_stride + kh * dim;
        for (int64_t d = 0; d < dim; d += Vec::size())
          transpose(keys + d, key_stride, w.kt.data() + d * Vec::size(), Vec::size(), m,
                    static_cast<int>(std::min<int64_t>(Vec::size(), dim - d)));
        for (int64_t tok = 0; tok < t.tokens; ++tok)
          for (int64_t gi = 0; gi < group; ++gi) {
            const int64_t i = tok * span + (kh - t.h0) * group + gi;
            scores_of(query[i], w.kt.data(), dim, scale, w.scores.data() + i * stride + held + t0, m);
          }
      }
    }
    if (window || j * block < first)  // the few keys a window hides
      for (int64_t i = 0; i < queries; ++i)
        for (int64_t u = 0; u < n; ++u)
          if (j * block + u < first || !sees(i, j * block + u)) w.scores[i * stride + held + u] = kNegInf;
    held += n;
    if (held + block > fold || (j + 1) * block >= t.context) update(held), held = 0;
  }
  for (int64_t u = 0; u < t.tokens; ++u) {  // the segment's own tokens, causal
    const float* key = k_at(t.b, t.s0 + u);
    w.rows[u] = v_at(t.b, t.s0 + u);
    for (int64_t i = 0; i < queries; ++i)
      w.scores[i * stride + u] =
          u <= i / span && sees(i, t.context + u) ? dot(query[i], key + offsets[i], dim) * scale : kNegInf;
  }
  update(t.tokens);
  for (int64_t i = 0; i < queries; ++i) w.sm.write(i, out_at(t.b, t.s0 + i / span) + (t.h0 * group + i % span) * dim);
}

template <typename C>
void Attention<C>::run_long(const Task& t, Scratch& w) const {
  const int64_t kh = t.h0, m = (t.e - t.a) * group;  // query row i: token a + i / group, head kh * group + i % group
  w.queries.resize(m * dim);
  w.scores.resize(m * kChunk);
  w.keys.resize(kChunk * dim);
  w.values.resize(kChunk * dim);
  w.sm.reset(m, dim);
  for (int64_t u = t.a; u < t.e; ++u) {  // the tile's queries of kv head kh, stacked and scaled
    const float* src = q_at(t.b, t.s0 + u) + kh * group * dim;
    float* dst = w.queries.data() + (u - t.a) * group * dim;
    for (int64_t x = 0; x < group * dim; ++x) dst[x] = src[x] * scale;
  }
  // One chunk of n keys (k, v: rows ldk, ldv apart) starting at position x0 of the segment's
  // positions (the context's, then its own tokens' at context + u); query row i sees [lo_i, hi_i).
  auto chunk = [&](const float* k, int ldk, const float* v, int ldv, int64_t x0, int64_t n) {
    gemm_nt(m, n, dim, w.queries.data(), dim, k, ldk, w.scores.data(), kChunk);
    for (int64_t i = 0; i < m; ++i) {
      const int64_t token = t.a + i / group;  // its position is context + token
      const int64_t lo = std::clamp<int64_t>(first_seen(t.context, token) - x0, 0, n);
      const int64_t hi = std::clamp<int64_t>(t.context + token + 1 - x0, 0, n);
      float* s = w.scores.data() + i * kChunk;
      const bool seen = hi > lo && w.sm.fold(i, s + lo, hi - lo);
      std::fill(s, s + (seen ? lo : n), 0.f);
      if (seen) std::fill(s + hi, s + n, 0.f);
    }
    gemm_nn_add(m, dim, n, w.scores.data(), kChunk, v, ldv, w.sm.acc.data(), dim);
  };
  const int64_t key_stride = kv_heads * dim;
  for (int64_t x0 = first_seen(t.context, t.a); x0 < t.context; x0 += kChunk) {  // the context
    const int64_t n = std::min(kChunk, t.context - x0);
    for (int64_t x = x0; x < x0 + n;) {  // gathered block by block: the run of slots in one block
      const int64_t run = std::min(block - x % block, x0 + n - x), base = slot(t.row, x) * key_stride + kh * dim;
      for (int64_t r = 0; r < run; ++r) {
        to_float(k_cache + base + r * key_stride, w.keys.data() + (x - x0 + r) * dim, dim);
        to_float(v_cache + base + r * key_stride, w.values.data() + (x - x0 + r) * dim, dim);
      }
      x += run;
    }
    chunk(w.keys.data(), dim, w.values.data(), dim, x0, n);
  }
  const int64_t own_first = std::max<int64_t>(0, first_seen(t.context, t.a) - t.context);
  for (int64_t u0 = own_first; u0 < t.e; u0 += kChunk) {  // the segment's own tokens, in place
    const int64_t n = std::min(kChunk, t.e - u0);
    chunk(k_at(t.b, t.s0 + u0) + kh * dim, static_cast<int>(k_tok), v_at(t.b, t.s0 + u0) + kh * dim,
          static_cast<int>(v_tok), t.context + u0, n);
  }
  for (int64_t i = 0; i < m; ++i)
    w.sm.write(i, out_at(t.b, t.s0 + t.a + i / group) + (kh * group + i % group) * dim);
}

// t itself when each token's heads are contiguous rows of D floats, else a contiguous copy.
at::Tensor token_rows(const at::Tensor& t) {
  return t.stride(3) == 1 && t.stride(2) == t.size(3) ? t : t.contiguous();
}

// Longest task first, each to the least loaded thread; then one parallel region, a thread's list each.
template <typename C>
void run(const Attention<C>& att) {
  const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  std::vector<Task> tasks = att.tasks(threads);
  std::sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
  std::vector<std::vector<Task>> lists(threads);
  std::vector<double> load(threads, 0.);
  for (const Task& t : tasks) {
    const auto least = std::min_element(load.begin(), load.end()) - load.begin();
    lists[least].push_back(t);
    load[least] += t.cost;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    for (int64_t thread = begin; thread < end; ++thread)
      for (const Task& t : lists[thread]) t.tokens <= kShortTokens ? att.run_short(t, w) : att.run_long(t, w);
  });
}

at::Tensor block_kv_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                              const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& table_in, const at::Tensor& lens_in,
                              const at::Tensor& segments_in, double scale,
                              std::optional<int64_t> window) {
  const at::ScalarType dtype = k_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "nb::block_kv_attention takes float32, bfloat16 or float16 tensors");
  for (const at::Tensor* t : {&q_in, &k_in, &v_in, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == dtype && t->device().is_cpu(),
                "nb::block_kv_attention takes CPU tensors of one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  // The step's own tensors in float32 (themselves when they already are), token rows contiguous.
  const at::Tensor q = token_rows(q_in.to(at::kFloat)), k_own = token_rows(k_in.to(at::kFloat));
  const at::Tensor v_own = token_rows(v_in.to(at::kFloat));
  const at::Tensor table = table_in.to(at::kLong).contiguous(), lens = lens_in.to(at::kLong).contiguous();
  const at::Tensor segments = segments_in.to(at::kLong).contiguous();
  const int64_t batch = q.size(0), rows = table.size(0);
  TORCH_CHECK(rows == batch || batch == 1, batch, " step rows over ", rows,
              " block-table rows: need one each, or one packed row");
  at::Tensor out = at::empty(q.sizes(), q.options());
  auto attend = [&](auto* cache_type) {
    using C = std::remove_pointer_t<decltype(cache_type)>;
    run(Attention<C>{q.data_ptr<float>(), k_own.data_ptr<float>(), v_own.data_ptr<float>(),
                     static_cast<const C*>(k_cache.const_data_ptr()), static_cast<const C*>(v_cache.const_data_ptr()),
                     table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), segments.data_ptr<int64_t>(),
                     out.data_ptr<float>(), batch, q.size(1), q.size(2), q.size(3), k_own.size(2),
                     q.size(2) / k_own.size(2), k_cache.size(1), rows, table.size(1), q.stride(0), q.stride(1),
                     k_own.stride(0), k_own.stride(1), v_own.stride(0), v_own.stride(1),
                     static_cast<float>(scale), window, rows != batch});
  };
  if (dtype == at::kBFloat16) attend(static_cast<at::BFloat16*>(nullptr));
  else if (dtype == at::kHalf) attend(static_cast<at::Half*>(nullptr));
  else attend(static_cast<float*>(nullptr));
  return out.to(dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(nb, CPU, m) { m.impl("block_kv_attention", &block_kv_attention); }
