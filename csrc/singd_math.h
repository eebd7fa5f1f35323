// Element math of the fused ops, shared by the CPU (csrc/cpu) and CUDA (csrc/cuda) kernels.
//
// Every function here works on one element in the accumulation type T (float for
// float32/bfloat16/float16 tensors, double for float64) and mirrors, operation by
// operation, the pure-PyTorch reference in singd_cuda/ops/reference.py. Keep the two in
// step: the reference is the test oracle.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cfloat>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#define SINGD_HD __host__ __device__ __forceinline__
#else
#define SINGD_HD inline
#endif

namespace singd {

// ---------------------------------------------------------------------------------------
// Counter-based random bits: a pure function of (seed, stream, element index), so the CPU
// and CUDA kernels and the reference draw identical bits. hash32 is a 32-bit integer
// finaliser whose multipliers are below 2^31, so the reference can evaluate it exactly in
// int64 tensor arithmetic.
// ---------------------------------------------------------------------------------------

SINGD_HD uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  x ^= x >> 15;
  x *= 0x735a2d97u;
  x ^= x >> 15;
  return x;
}

// Key of one tensor of a list: `stream` is the tensor's position in the list.
SINGD_HD uint32_t stream_key(int64_t seed, int64_t stream) {
  const uint64_t s = static_cast<uint64_t>(seed);
  uint32_t k = hash32(static_cast<uint32_t>(s >> 32));
  k = hash32(k ^ static_cast<uint32_t>(s));
  return hash32(k ^ static_cast<uint32_t>(stream));
}

// 32 random bits for element `index` (row-major position) of the tensor keyed by `key`.
SINGD_HD uint32_t random_bits(uint32_t key, int64_t index) {
  const uint64_t i = static_cast<uint64_t>(index);
  return hash32(hash32(key ^ static_cast<uint32_t>(i >> 32)) ^ static_cast<uint32_t>(i));
}

SINGD_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
#endif
}

// float -> bfloat16 with stochastic rounding: add the top 16 random bits below the kept
// mantissa and truncate, so x rounds up with probability (distance to the lower neighbour)
// / (spacing). Infinities stay infinite; NaNs become the canonical quiet NaN 0x7fc0.
// Branch-free so that CPU loops vectorise.
SINGD_HD c10::BFloat16 bf16_stochastic(float x, uint32_t bits) {
  const uint32_t b = float_bits(x);
  const bool nan = (b & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = nan ? 0x7fc00000u : b + (bits >> 16);
  return c10::BFloat16(static_cast<uint16_t>(rounded >> 16), c10::BFloat16::from_bits());
}

// Parameter write: round-to-nearest-even, or stochastic rounding for bfloat16 when asked.
template <typename S, typename T>
SINGD_HD S store_param(T v, bool stochastic, uint32_t key, int64_t index) {
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    if (stochastic) {
      return bf16_stochastic(static_cast<float>(v), random_bits(key, index));
    }
  }
  return static_cast<S>(v);
}

// ---------------------------------------------------------------------------------------
// Update epilogue. Host code fills Epilogue from the op's arguments:
//   inv_scale    loss-scale inverse (1 when absent: g * 1 == g bitwise)
//   wd_coupled   weight_decay when coupled (L2 added to the direction), else 0
//   p_scale      1 - lr * weight_decay when decoupled, else 1 (p * 1 == p bitwise)
//   lr           SGD step size;  step_size = lr / (1 - beta^step) for the Adam form
//   momentum     SGD momentum or the Adam beta;  one_minus_beta = 1 - beta
//   damping      AdaFisher's additive damping of F
// The conditions below are loop-invariant selects, so CPU loops stay vectorisable.
// ---------------------------------------------------------------------------------------

template <typename T>
struct Epilogue {
  T inv_scale;
  T wd_coupled;
  T p_scale;
  T lr;
  T step_size;
  T momentum;
  T one_minus_beta;
  T damping;
};

// u = g * inv_scale (+ weight_decay * p when coupled).
template <typename T>
SINGD_HD T direction(T g, T p, const Epilogue<T>& e) {
  const T u = g * e.inv_scale;
  return e.wd_coupled != T(0) ? u + e.wd_coupled * p : u;
}

// SGD with momentum (kMomentum): buf = momentum * buf + u; p = p * p_scale - lr * buf.
// Without momentum the step is u and buf is untouched. Returns the new p.
template <bool kMomentum, typename T>
SINGD_HD T sgd_element(T p, T g, T& buf, const Epilogue<T>& e) {
  T d = direction(g, p, e);
  if constexpr (kMomentum) {
    buf = e.momentum * buf + d;
    d = buf;
  }
  return p * e.p_scale - e.lr * d;
}

// Adam-style momentum without a square root: m = beta * m + (1 - beta) * u;
// p = p * p_scale - step_size * (m / denom). denom is 1 for the plain epilogue and
// AdaFisher's F_ij for the diagonal path. Returns the new p.
template <typename T>
SINGD_HD T adam_element(T p, T g, T& m, T denom, const Epilogue<T>& e) {
  const T u = direction(g, p, e);
  m = e.momentum * m + e.one_minus_beta * u;
  return p * e.p_scale - e.step_size * (m / denom);
}

// SINGD with diagonal factors: direction (c_i^2 k_j^2) g_ij, then the SGD epilogue.
template <bool kMomentum, typename T>
SINGD_HD T singd_diag_element(T p, T g, T& buf, T row, T col, const Epilogue<T>& e) {
  return sgd_element<kMomentum>(p, (row * col) * g, buf, e);
}

// AdaFisher: F_ij = s'_i h'_j + damping formed on the fly, then the Adam-style epilogue
// with each element's step bounded by lr: F is min-max normalised into [damping,
// 1 + damping], so unbounded the step would be up to lr / damping times the gradient,
// whatever the gradient's scale (NaN passes through the bound).
template <typename T>
SINGD_HD T adafisher_element(T p, T g, T& m, T row, T col, const Epilogue<T>& e) {
  const T u = direction(g, p, e);
  m = e.momentum * m + e.one_minus_beta * u;
  T step = e.step_size * (m / (row * col + e.damping));
  step = step > e.lr ? e.lr : (step < -e.lr ? -e.lr : step);
  return p * e.p_scale - step;
}

// ---------------------------------------------------------------------------------------
// Diagonal SINGD factor update (one side):
//   m_hat = 0.5 * (a * h + (damping * b) * k^2 - 1);  m = alpha1 * m + m_hat;
//   k = k * (1 - beta1 * m).
// a = tr̄(H_other) and b = tr̄(Π̂(other^T other)) per layer (1 for IKFAC); lam_b = damping * b.
// ---------------------------------------------------------------------------------------

template <typename T>
SINGD_HD void factor_element(T& k, T& m, T h, T a, T lam_b, T alpha1, T beta1) {
  const T m_hat = T(0.5) * (a * h + lam_b * (k * k) - T(1));
  m = alpha1 * m + m_hat;
  k = k * (T(1) - beta1 * m);
}

// ---------------------------------------------------------------------------------------
// Convolution patches: the output positions o along one spatial axis whose input index
// o * stride + (i * dilation - padding) for kernel offset i lies in [0, n); the range is
// [*first, *last) within [0, out).
// ---------------------------------------------------------------------------------------

SINGD_HD void valid_outputs(int64_t n, int64_t out, int64_t stride, int64_t padding, int64_t i,
                            int64_t dilation, int64_t* first, int64_t* last) {
  const int64_t offset = i * dilation - padding;
  int64_t lo = offset >= 0 ? 0 : (-offset + stride - 1) / stride;
  int64_t hi = n - 1 - offset < 0 ? 0 : (n - 1 - offset) / stride + 1;
  lo = lo < out ? lo : out;
  hi = hi < out ? hi : out;
  *first = lo;
  *last = hi > lo ? hi : lo;
}

// ---------------------------------------------------------------------------------------
// Min–max normalisation of a row (AdaFisher's s′ and h′), from its minimum and maximum
// (both NaN when it holds a NaN, as aminmax gives them), as the reference's ops round it:
//   span = max - min;  constant = 1 - sign(span)  (1 for a constant row, else 0);
//   span = max(span + constant, tiny)  (NaN stays NaN, as clamp_min);
//   x′ = (x - min + constant) / span.
// ---------------------------------------------------------------------------------------

template <typename T>
struct RowScale {
  T low, constant, span;
};

template <typename T>
SINGD_HD RowScale<T> min_max_scale(T low, T high) {
  const T tiny = sizeof(T) == sizeof(float) ? static_cast<T>(FLT_MIN) : static_cast<T>(DBL_MIN);
  T span = high - low;
  const T sign = static_cast<T>(static_cast<int>(T(0) < span) - static_cast<int>(span < T(0)));
  const T constant = T(1) - sign;
  span = span + constant;
  span = span < tiny ? tiny : span;  // (false for NaN: it stays)
  return {low, constant, span};
}

template <typename T>
SINGD_HD T min_max_element(T x, const RowScale<T>& r) {
  return (x - r.low + r.constant) / r.span;
}

}  // namespace singd
