// A bfloat16 projection on the CPU: an AVX512-BF16 GEMM over a weight packed once at load, summed
// in float32 and rounded once to bfloat16 as the output is written. bf16_linear_cpu.py defines the
// op's schema, packs the weight, builds this file and documents why it exists.
//
// The packed weight holds the same N x K values as the checkpoint's, reordered so that a thread
// streams one 32-channel group at a time: group g, then every pair of input features k, then 2
// blocks of 16 channels, each channel's 2 values together. One 64-byte load is then 16 channels x
// 2 features, one operand of vdpbf16ps; the token's 2 values are broadcast as the other. A tile of
// up to 8 tokens keeps 16 accumulators, so a decode step's rows read each weight once; further
// tiles of a longer call re-read the group (128 KiB at 2048 features) from L2.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;        // output channels a thread computes together
constexpr int kBlocks = kGroup / 16;  // 16-channel blocks of a group: one register each
constexpr int64_t kTile = 8;          // tokens sharing one pass over a group's weights
constexpr int64_t kPrefetch = 4096;   // bytes ahead of the group's stream

template <int64_t MT>
void tile(const uint16_t* x, int64_t k_size, const uint16_t* w, uint16_t* out, int64_t n_size) {
  __m512 acc[MT][kBlocks];
  for (int64_t m = 0; m < MT; ++m)
    for (int j = 0; j < kBlocks; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < k_size / 2; ++kp) {
    const uint16_t* wk = w + kp * 2 * kGroup;
    __m512bh wv[kBlocks];
    for (int j = 0; j < kBlocks; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetch + 64 * j, _MM_HINT_T0);
      wv[j] = (__m512bh)_mm512_loadu_si512(wk + 32 * j);
    }
    for (int64_t m = 0; m < MT; ++m) {
      int32_t two;
      std::memcpy(&two, x + m * k_size + kp * 2, sizeof two);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(two);
      for (int j = 0; j < kBlocks; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], a);
    }
  }
  for (int64_t m = 0; m < MT; ++m)
    for (int j = 0; j < kBlocks; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * n_size + 16 * j),
                          (__m256i)_mm512_cvtneps_pbh(acc[m][j]));
}

template <int64_t... MT>
void run_tile(int64_t rows, const uint16_t* x, int64_t k_size, const uint16_t* w, uint16_t* out,
              int64_t n_size, std::integer_sequence<int64_t, MT...>) {
  // tile<rows>: one instantiation per tile height, 1 to kTile
  ((rows == MT + 1 ? (tile<MT + 1>(x, k_size, w, out, n_size), 0) : 0), ...);
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t k_size = x.size(-1), n_size = weight.size(0);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "nb::bf16_linear: bfloat16 activations, not ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == k_size && weight.scalar_type() == at::kBFloat16 &&
                  weight.is_contiguous(),
              "nb::bf16_linear: the weight must be the packed (out, in) bfloat16 tensor of in = ", k_size);
  TORCH_CHECK(n_size % kGroup == 0 && k_size % 2 == 0, "nb::bf16_linear: out (", n_size,
              ") must be a multiple of 32 and in (", k_size, ") of 2");
  const at::Tensor flat = x.reshape({-1, k_size}).contiguous();
  const int64_t m_size = flat.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n_size;
  at::Tensor out = at::empty(shape, x.options());
  const auto* xs = static_cast<const uint16_t*>(flat.const_data_ptr());
  const auto* w = static_cast<const uint16_t*>(weight.const_data_ptr());
  auto* o = static_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, n_size / kGroup, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t m0 = 0; m0 < m_size; m0 += kTile)
        run_tile(std::min(kTile, m_size - m0), xs + m0 * k_size, k_size, w + g * kGroup * k_size,
                 o + m0 * n_size + g * kGroup, n_size, std::make_integer_sequence<int64_t, kTile>{});
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nb, CPU, m) { m.impl("bf16_linear", &bf16_linear); }
