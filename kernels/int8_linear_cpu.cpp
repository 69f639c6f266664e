// An INT8 W8A8 projection on the CPU: the activations quantized per token in here, then an
// AVX512-VNNI GEMM over a weight packed once at load, the weight's and the token's scales applied
// as the output is written. int8_linear_cpu.py defines the op's schema, packs the weight, builds
// this file and documents why it exists.
//
// The packed weight holds the same N x K bytes as the checkpoint's, reordered so that a thread
// streams one 64-channel group at a time: group g, then every 4 input features k, then 4 blocks
// of 16 channels, each channel's 4 bytes together, each byte w + 128 (as unsigned). One 64-byte
// load is then 16 channels x 4 features, the unsigned operand of vpdpbusd; the token's 4 int8
// values are broadcast as the signed one. The sum of (w + 128) * q is the sum of w * q plus
// 128 times the token's sum of q, which is taken away before the scales: exact int32 arithmetic.
// A tile of up to 4 tokens keeps 16 accumulators; further tiles re-read the group from L2.
//
// Quantization matches model/quantized_linear.py's per_token_int8 in float32: the scale is the
// token's largest magnitude (at least the smallest normal float) over 127, each value divided by
// it, rounded half to even and clamped to [-127, 127].

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGroup = 64;  // output channels a thread computes together
constexpr int64_t kTile = 4;    // tokens sharing one pass over a group's weights
constexpr int64_t kPrefetch = 4096;  // bytes ahead of the group's stream

template <int64_t MT, typename T>
void tile(const int8_t* q, const int32_t* qsum, const float* xscale, int64_t k_size, const uint8_t* w,
          const float* wscale, T* out, int64_t n_size) {
  __m512i acc[MT][4];
  for (int64_t m = 0; m < MT; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_si512();
  for (int64_t kg = 0; kg < k_size / 4; ++kg) {
    const uint8_t* wk = w + kg * 4 * kGroup;
    for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch + 64 * j), _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(wk), w1 = _mm512_loadu_si512(wk + 64);
    const __m512i w2 = _mm512_loadu_si512(wk + 128), w3 = _mm512_loadu_si512(wk + 192);
    for (int64_t m = 0; m < MT; ++m) {
      int32_t four;
      std::memcpy(&four, q + m * k_size + kg * 4, sizeof four);
      const __m512i a = _mm512_set1_epi32(four);
      acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], w0, a);
      acc[m][1] = _mm512_dpbusd_epi32(acc[m][1], w1, a);
      acc[m][2] = _mm512_dpbusd_epi32(acc[m][2], w2, a);
      acc[m][3] = _mm512_dpbusd_epi32(acc[m][3], w3, a);
    }
  }
  alignas(64) float row[kGroup];
  for (int64_t m = 0; m < MT; ++m) {
    const __m512i shift = _mm512_set1_epi32(128 * qsum[m]);
    for (int j = 0; j < 4; ++j) {
      const __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][j], shift)),
                                     _mm512_loadu_ps(wscale + 16 * j));
      _mm512_store_ps(row + 16 * j, _mm512_mul_ps(y, _mm512_set1_ps(xscale[m])));
    }
    for (int64_t n = 0; n < kGroup; ++n) out[m * n_size + n] = static_cast<T>(row[n]);
  }
}

template <typename T>
void quantize(const T* x, int64_t m_size, int64_t k_size, int8_t* q, int32_t* qsum, float* xscale) {
  at::parallel_for(0, m_size, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(k_size);
    for (int64_t m = begin; m < end; ++m) {
      float amax = 0.f;
      for (int64_t k = 0; k < k_size; ++k) {
        h[k] = static_cast<float>(x[m * k_size + k]);
        amax = std::max(amax, std::fabs(h[k]));
      }
      const float scale = std::max(amax, FLT_MIN) / 127.0f;
      int32_t sum = 0;
      for (int64_t k = 0; k < k_size; ++k) {
        const float v = std::min(std::max(std::nearbyint(h[k] / scale), -127.0f), 127.0f);
        q[m * k_size + k] = static_cast<int8_t>(v);
        sum += static_cast<int32_t>(v);
      }
      qsum[m] = sum;
      xscale[m] = scale;
    }
  });
}

template <typename T>
void gemm(const int8_t* q, const int32_t* qsum, const float* xscale, int64_t m_size, int64_t k_size,
          const uint8_t* w, const float* wscale, T* out, int64_t n_size) {
  at::parallel_for(0, n_size / kGroup, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* wg = w + g * kGroup * k_size;
      for (int64_t m0 = 0; m0 < m_size; m0 += kTile) {
        auto* o = out + m0 * n_size + g * kGroup;
        const auto* qm = q + m0 * k_size;
        const float* ws = wscale + g * kGroup;
        switch (std::min(kTile, m_size - m0)) {
          case 4: tile<4>(qm, qsum + m0, xscale + m0, k_size, wg, ws, o, n_size); break;
          case 3: tile<3>(qm, qsum + m0, xscale + m0, k_size, wg, ws, o, n_size); break;
          case 2: tile<2>(qm, qsum + m0, xscale + m0, k_size, wg, ws, o, n_size); break;
          default: tile<1>(qm, qsum + m0, xscale + m0, k_size, wg, ws, o, n_size);
        }
      }
    }
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  const int64_t k_size = x.size(-1), n_size = weight.size(0);
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == k_size && weight.scalar_type() == at::kChar &&
                  weight.is_contiguous(),
              "nb::int8_linear: the weight must be the packed (out, in) int8 tensor of in = ", k_size);
  TORCH_CHECK(n_size % kGroup == 0 && k_size % 4 == 0, "nb::int8_linear: out (", n_size,
              ") must be a multiple of 64 and in (", k_size, ") of 4");
  TORCH_CHECK(scale.numel() == n_size, "nb::int8_linear: one float32 scale per output channel");
  const at::Tensor flat = x.reshape({-1, k_size}).contiguous();
  const at::Tensor wscale = scale.to(at::kFloat).contiguous();
  const int64_t m_size = flat.size(0);
  std::vector<int8_t> q(m_size * k_size);
  std::vector<int32_t> qsum(m_size);
  std::vector<float> xscale(m_size);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n_size;
  at::Tensor out = at::empty(shape, x.options());
  const auto* w = static_cast<const uint8_t*>(weight.const_data_ptr());
  auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    quantize(static_cast<const T*>(flat.const_data_ptr()), m_size, k_size, q.data(), qsum.data(), xscale.data());
    gemm(q.data(), qsum.data(), xscale.data(), m_size, k_size, w, wscale.const_data_ptr<float>(),
         static_cast<T*>(out.data_ptr()), n_size);
  };
  if (x.scalar_type() == at::kBFloat16) run(static_cast<at::BFloat16*>(nullptr));
  else if (x.scalar_type() == at::kHalf) run(static_cast<at::Half*>(nullptr));
  else if (x.scalar_type() == at::kFloat) run(static_cast<float*>(nullptr));
  else TORCH_CHECK(false, "nb::int8_linear: activations in float32, bfloat16 or float16, not ", x.scalar_type());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nb, CPU, m) { m.impl("int8_linear", &int8_linear); }
