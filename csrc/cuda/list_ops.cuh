// Host-side helpers of the CUDA list ops (csrc/cuda/epilogue.cu, diag_step.cu,
// factor_update.cu): dtype groups, vector widths and the launch entries. Each list op runs
// one multi-tensor launch per dtype combination (per kMax tensors) with 16-byte vector
// access; only the unaligned head and the tail of each chunk take scalar access.
// found_inf and inv_scale are read on the device. Element math: singd_math.h.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <map>
#include <tuple>
#include <vector>

#include "device_utils.cuh"

namespace singd::cuda {

// Indices of `params` grouped by the dtypes of (params[i], a[i], b[i]); b may be empty.
inline std::map<std::tuple<int, int, int>, std::vector<size_t>> group_by_dtype(
    at::TensorList params, const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  std::map<std::tuple<int, int, int>, std::vector<size_t>> groups;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto key = std::make_tuple(
        static_cast<int>(params[i].scalar_type()), static_cast<int>(a[i].scalar_type()),
        static_cast<int>((b.empty() ? params[i] : b[i]).scalar_type()));
    groups[key].push_back(i);
  }
  return groups;
}

// Vector width of a parameter dtype: 16 bytes of parameters.
template <typename P>
constexpr int vec_width() {
  return static_cast<int>(16 / sizeof(P));
}

// Entry of tensor `stream`: `elem_bytes` is the element size of each pointer accessed by
// vector of `width` elements (0 for the others; null pointers are not accessed).
template <int NPTR>
Entry<NPTR> make_entry(const std::array<void*, NPTR>& ptrs,
                       const std::array<int64_t, NPTR>& elem_bytes, int width, int64_t numel,
                       int64_t cols, size_t stream) {
  Entry<NPTR> e{};
  for (int j = 0; j < NPTR; ++j) e.ptr[j] = ptrs[j];
  set_vector_access<NPTR>(e, elem_bytes, width);
  e.numel = numel;
  e.cols = cols;
  e.stream = static_cast<int32_t>(stream);
  return e;
}

// Pointer of a tensor the kernels only read (the Entry holds untyped pointers).
inline void* read_only(const at::Tensor& t) { return const_cast<void*>(t.const_data_ptr()); }

}  // namespace singd::cuda
