// Block-KV attention for short rows (decode, speculative drafts) on the CPU, in float32: the
// contract of block_kv_torch.block_kv_attention, with each cached K and V vector read once, in
// place, through the block table. block_kv_cpu.py defines the op's schema, builds this file and
// documents why it exists.
//
// One task per step row (per row and kv head when rows are fewer than threads). Within a task the
// row's tokens go segment by segment; every query of a segment (its tokens times the task's heads)
// meets each key as it is loaded, and an online softmax runs block by block over the segment's
// context, then over the segment's own tokens. Positions at or past a context's length are never
// read, so whatever the cache holds there (the null block, stale or NaN data) cannot reach an
// output. A query that sees no key at all (a pad) gets zeros.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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

// s = exp(s - top) in place; returns the sum. exp(-inf) is 0: invisible keys weigh nothing.
inline float exp_sum(float* s, float top, int64_t n) {
  Vec total(0.f);
  for (int64_t t = 0; t < n; t += Vec::size()) {
    const int64_t count = std::min<int64_t>(Vec::size(), n - t);
    Vec p = (Vec::loadu(s + t, count) - Vec(top)).exp();
    p.store(s + t, count);
    total = total + Vec::set(Vec(0.f), p, count);
  }
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, total);
}

// The running softmax of one segment's queries (its tokens times the task's heads).
struct Softmax {
  int64_t queries, dim;
  std::vector<float> top, total, acc, scores;  // (Q), (Q), (Q, D), (Q, keys of one block)

  Softmax(int64_t q, int64_t d, int64_t block) :
      queries(q), dim(d), top(q, kNegInf), total(q, 0.f), acc(q * d, 0.f), scores(q * block) {}

  // Fold in ``n`` keys whose scores are in ``scores`` (query-major, ``stride`` apart); query i's
  // value vectors are ``values[t] + offsets[i]``.
  void update(int64_t n, int64_t stride, const std::vector<const float*>& values,
              const std::vector<int64_t>& offsets) {
    for (int64_t i = 0; i < queries; ++i) {
      float* s = scores.data() + i * stride;
      const float block_top = *std::max_element(s, s + n);
      if (block_top == kNegInf) continue;  // nothing of this block is visible to query i
      const float new_top = std::max(top[i], block_top);
      const float rescale = std::exp(top[i] - new_top);  // exp(-inf) = 0 on the first visible block
      float* a = acc.data() + i * dim;
      scale_by(a, rescale, dim);
      total[i] = total[i] * rescale + exp_sum(s, new_top, n);
      accumulate(a, s, values, offsets[i], n, dim);  // invisible keys weigh exp(-inf) = 0
      top[i] = new_top;
    }
  }
};

at::Tensor block_kv_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                              const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& table_in, const at::Tensor& lens_in,
                              const at::Tensor& segments_in, double scale_in,
                              std::optional<int64_t> window) {
  for (const at::Tensor* t : {&q_in, &k_in, &v_in, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(),
                "nb::block_kv_attention takes float32 CPU tensors");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  const at::Tensor q = q_in.contiguous(), k_own = k_in.contiguous(), v_own = v_in.contiguous();
  const at::Tensor table = table_in.to(at::kLong).contiguous(), lens = lens_in.to(at::kLong).contiguous();
  const at::Tensor segments = segments_in.to(at::kLong).contiguous();
  const int64_t batch = q.size(0), seq = q.size(1), heads = q.size(2), dim = q.size(3);
  const int64_t kv_heads = k_own.size(2), group = heads / kv_heads;
  const int64_t block = k_cache.size(1), rows = table.size(0), cols = table.size(1);
  TORCH_CHECK(rows == batch || batch == 1, batch, " step rows over ", rows,
              " block-table rows: need one each, or one packed row");
  const bool packed = rows != batch;  // one row whose segment g reads block-table row g
  const float scale = static_cast<float>(scale_in);
  at::Tensor out = at::empty_like(q);

  const float* qp = q.data_ptr<float>();
  const float* kop = k_own.data_ptr<float>();
  const float* vop = v_own.data_ptr<float>();
  const float* kcp = k_cache.data_ptr<float>();
  const float* vcp = v_cache.data_ptr<float>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = segments.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t key_stride = kv_heads * dim;  // between slots of a block, and tokens of the step

  // A task is one step row and a range of its kv heads: every head when there are rows enough to
  // share out, so that each slot's K/V row is read whole and in order; one head each otherwise.
  const int64_t splits = batch >= at::get_num_threads() ? 1 : kv_heads;
  at::parallel_for(0, batch * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<const float*> values(std::max(block, seq));
    std::vector<float> kt(((dim + Vec::size() - 1) / Vec::size()) * Vec::size() * Vec::size());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / splits, part = task % splits;
      const int64_t h0 = part * kv_heads / splits, h1 = (part + 1) * kv_heads / splits;
      const int64_t span = (h1 - h0) * group;  // query heads of the task
      const int64_t* seg = sp + b * seq;
      for (int64_t s0 = 0; s0 < seq;) {  // one segment: the run of tokens s0 .. s1 - 1
        int64_t s1 = s0 + 1;
        while (s1 < seq && seg[s1] == seg[s0]) ++s1;
        const int64_t g = seg[s0];
        const int64_t row = packed ? (g >= 0 && g < rows ? g : -1) : (g == 0 ? b : -1);
        const int64_t context = row < 0 ? 0 : std::clamp<int64_t>(lp[row], 0, cols * block);
        const int64_t tokens = s1 - s0, queries = tokens * span;
        // query i = (token s0 + i / span, head h0 * group + i % span), reading kv head
        // offsets[i] / dim; token s sits at position context + (s - s0), so with a window W it
        // sees the context positions above that minus W.
        std::vector<int64_t> offsets(queries);
        std::vector<const float*> query(queries);
        for (int64_t i = 0; i < queries; ++i) {
          const int64_t head = h0 * group + i % span;
          offsets[i] = head / group * dim;
          query[i] = qp + ((b * seq + s0 + i / span) * heads + head) * dim;
        }
        auto sees = [&](int64_t i, int64_t position) {
          return !window || context + i / span - position < *window;
        };
        const int64_t stride = std::max(block, tokens);
        Softmax sm(queries, dim, stride);
        const int64_t first = window ? std::max<int64_t>(0, context - *window + 1) : 0;
        for (int64_t j = first / block; j * block < context; ++j) {
          const int64_t physical = std::max<int64_t>(tp[row * cols + j], 0);
          const int64_t n = std::min(block, context - j * block);
          const int64_t base = physical * block * key_stride;
          if ((j + 1) * block < context) {  // the next block's K and V, while this one is computed
            const int64_t next = std::max<int64_t>(tp[row * cols + j + 1], 0) * block * key_stride;
            for (int64_t x = 0; x < block * key_stride; x += 64 / sizeof(float)) {
              __builtin_prefetch(kcp + next + x);
              __builtin_prefetch(vcp + next + x);
            }
          }
          for (int64_t t = 0; t < n; ++t) values[t] = vcp + base + t * key_stride;
          for (int64_t t0 = 0; t0 < n; t0 += Vec::size()) {  // Vec::size() slots at a time
            const int m = static_cast<int>(std::min<int64_t>(Vec::size(), n - t0));
            for (int64_t kh = h0; kh < h1; ++kh) {
              const float* keys = kcp + base + t0 * key_stride + kh * dim;
              for (int64_t d = 0; d < dim; d += Vec::size())
                transpose(keys + d, key_stride, kt.data() + d * Vec::size(), Vec::size(), m,
                          static_cast<int>(std::min<int64_t>(Vec::size(), dim - d)));
              for (int64_t tok = 0; tok < tokens; ++tok)
                for (int64_t gi = 0; gi < group; ++gi) {
                  const int64_t i = tok * span + (kh - h0) * group + gi;
                  scores_of(query[i], kt.data(), dim, scale, sm.scores.data() + i * stride + t0, m);
                }
            }
          }
          if (window || j * block < first)  // the few keys a window hides
            for (int64_t i = 0; i < queries; ++i)
              for (int64_t t = 0; t < n; ++t)
                if (j * block + t < first || !sees(i, j * block + t)) sm.scores[i * stride + t] = kNegInf;
          sm.update(n, stride, values, offsets);
        }
        for (int64_t u = 0; u < tokens; ++u) {  // the segment's own tokens, causal
          const int64_t token = (b * seq + s0 + u) * key_stride;
          values[u] = vop + token;
          for (int64_t i = 0; i < queries; ++i)
            sm.scores[i * stride + u] = u <= i / span && sees(i, context + u)
                                            ? dot(query[i], kop + token + offsets[i], dim) * scale : kNegInf;
        }
        sm.update(tokens, stride, values, offsets);
        for (int64_t i = 0; i < queries; ++i) {
          float* o = op + (query[i] - qp);
          const float* a = sm.acc.data() + i * dim;
          const float inv = sm.total[i] > 0.f ? 1.f / sm.total[i] : 0.f;
          std::copy(a, a + dim, o);
          scale_by(o, inv, dim);
        }
        s0 = s1;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nb, CPU, m) { m.impl("block_kv_attention", &block_kv_attention); }
