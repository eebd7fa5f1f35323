// CUDA kernel of min_max_normalise_rows_ (see csrc/cpu/normalise.cpp): one block per row.
// The minimum and maximum are exact whatever the order of the reduction, so the result is
// bitwise the CPU kernel's and the reference's.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

#include "../op_checks.h"
#include "device_utils.cuh"

namespace singd::cuda {
namespace {

constexpr int kRowThreads = 256;

// Block b: row b of v (v_stride elements apart) into row b of out, normalised.
template <typename S, typename T>
__global__ void __launch_bounds__(kRowThreads)
    normalise_rows_kernel(const S* v, int64_t v_stride, T* out, int64_t out_stride, int64_t d) {
  __shared__ T lows[kRowThreads];
  __shared__ T highs[kRowThreads];
  __shared__ int nans[kRowThreads];
  __shared__ RowScale<T> scale;
  const S* x = v + static_cast<int64_t>(blockIdx.x) * v_stride;
  T* o = out + static_cast<int64_t>(blockIdx.x) * out_stride;
  T low = std::numeric_limits<T>::infinity();
  T high = -low;
  int nan = 0;
  for (int64_t j = threadIdx.x; j < d; j += kRowThreads) {
    const T value = static_cast<T>(x[j]);
    o[j] = value;
    nan |= value != value;
    low = value < low ? value : low;
    high = value > high ? value : high;
  }
  lows[threadIdx.x] = low;
  highs[threadIdx.x] = high;
  nans[threadIdx.x] = nan;
  __syncthreads();
  for (int half = kRowThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      const int other = threadIdx.x + half;
      lows[threadIdx.x] = lows[other] < lows[threadIdx.x] ? lows[other] : lows[threadIdx.x];
      highs[threadIdx.x] = highs[other] > highs[threadIdx.x] ? highs[other] : highs[threadIdx.x];
      nans[threadIdx.x] |= nans[other];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const T quiet = std::numeric_limits<T>::quiet_NaN();
    scale = nans[0] ? min_max_scale(quiet, quiet) : min_max_scale(lows[0], highs[0]);
  }
  __syncthreads();
  const RowScale<T> s = scale;
  for (int64_t j = threadIdx.x; j < d; j += kRowThreads) o[j] = min_max_element(o[j], s);
}

void min_max_normalise_rows_cuda(at::Tensor& out, const at::Tensor& v) {
  const NormaliseRows r = check_normalise_rows(out, v);
  if (r.rows == 0) return;
  TORCH_CHECK(out.is_cuda(), "min_max_normalise_rows_: expected CUDA tensors");
  TORCH_CHECK(r.rows <= std::numeric_limits<int>::max(),
              "min_max_normalise_rows_: too many rows");
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "min_max_normalise_rows_", [&] {
    using T = scalar_t;
    T* o = out.data_ptr<T>();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, v.scalar_type(), "min_max_normalise_rows_", [&] {
          normalise_rows_kernel<scalar_t, T>
              <<<static_cast<unsigned>(r.rows), kRowThreads, 0, stream>>>(
                  v.const_data_ptr<scalar_t>(), r.v_stride, o, r.out_stride, r.d);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  });
}

}  // namespace
}  // namespace singd::cuda

TORCH_LIBRARY_IMPL(singd_cuda, CUDA, m) {
  m.impl("min_max_normalise_rows_", &singd::cuda::min_max_normalise_rows_cuda);
}
