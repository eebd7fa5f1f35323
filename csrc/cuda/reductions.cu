// CUDA kernels of the statistics reductions (see csrc/cpu/reductions.cpp for the
// definitions). Channels-last 4-D inputs are read in place. Each block writes one partial sum per output into a (splits, d) buffer that
// is then summed in a fixed order, so results are deterministic (no atomics).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "../op_checks.h"
#include "device_utils.cuh"

namespace singd::cuda {
namespace {

constexpr int kColsX = 32;  // threads across columns in the column kernel
constexpr int kRowsY = 8;   // threads across rows in the column kernel

// x (rows, d) row-major; thread (tx, ty) of block (bx, by) sums V consecutive columns over
// rows by*kRowsY + ty + k*kRowsY*gridDim.y; partial[by, c] = block total of column c. The
// shared totals are laid out [y][j][tx] so that a warp's 32 threads write 32 consecutive
// words for every j (no bank conflicts whatever V is).
template <int V, typename S, typename T>
__global__ void __launch_bounds__(kColsX* kRowsY)
    column_kernel(const S* x, int64_t rows, int64_t d, T* partial) {
  __shared__ T totals[kRowsY][V][kColsX];
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * kColsX + threadIdx.x) * V;
  T acc[V] = {};
  if (c0 < d) {
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * kRowsY + threadIdx.y; r < rows;
         r += static_cast<int64_t>(kRowsY) * gridDim.y) {
      T v[V];
      if (V == 1 || c0 + V <= d) {
        load<V>(x + r * d, c0, v);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) v[j] = c0 + j < d ? static_cast<T>(x[r * d + c0 + j]) : T(0);
      }
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] += v[j] * v[j];
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) totals[threadIdx.y][j][threadIdx.x] = acc[j];
  __syncthreads();
  if (threadIdx.y == 0) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      T t = T(0);
#pragma unroll
      for (int y = 0; y < kRowsY; ++y) t += totals[y][j][threadIdx.x];
      if (c0 + j < d) partial[blockIdx.y * d + c0 + j] = t;
    }
  }
}

// x (outer, d, inner) contiguous; block (c, by) sums channel c over the slices
// o = by, by + gridDim.y, ...; partial[by, c] = block total.
template <int V, typename S, typename T>
__global__ void __launch_bounds__(kThreads)
    channel_kernel(const S* x, int64_t outer, int64_t d, int64_t inner, T* partial) {
  const int64_t c = blockIdx.x;
  T acc = T(0);
  for (int64_t o = blockIdx.y; o < outer; o += gridDim.y) {
    const S* seg = x + (o * d + c) * inner;
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * V; i < inner; i += kThreads * V) {
      T v[V];
      load<V>(seg, i, v);
#pragma unroll
      for (int j = 0; j < V; ++j) acc += v[j] * v[j];
    }
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.y * d + c] = acc;
}

// channel_kernel for small slices (2 * inner <= kThreads, e.g. 7 x 7 maps): block (c, by)
// works on kThreads / inner slices at once, thread t on element t % inner of slice
// by * slices + t / inner (then every gridDim.y * slices further); partial[by, c].
template <typename S, typename T>
__global__ void __launch_bounds__(kThreads)
    small_channel_kernel(const S* x, int64_t outer, int64_t d, int inner, T* partial) {
  const int64_t c = blockIdx.x;
  const int slices = kThreads / inner;
  const int slice = static_cast<int>(threadIdx.x) / inner;
  const int lane = static_cast<int>(threadIdx.x) - slice * inner;
  T acc = T(0);
  if (slice < slices) {
    for (int64_t o = static_cast<int64_t>(blockIdx.y) * slices + slice; o < outer;
         o += static_cast<int64_t>(gridDim.y) * slices) {
      const T v = static_cast<T>(x[(o * d + c) * inner + lane]);
      acc += v * v;
    }
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.y * d + c] = acc;
}

// Sum of a (splits, n) partial buffer over its splits.
at::Tensor total(const at::Tensor& partial) {
  return partial.size(0) == 1 ? partial[0] : partial.sum(0);
}

// A 4-D channels-last tensor reduced over every dimension but the channels is a (B*H*W, C)
// row-major matrix: its column sums need no contiguous copy.
bool channels_last_columns(const at::Tensor& x, int64_t dim) {
  return x.dim() == 4 && at::maybe_wrap_dim(dim, x.dim()) == 1 && !x.is_contiguous() &&
         x.is_contiguous(at::MemoryFormat::ChannelsLast);
}

// The sums of squares of col_sum_squares (without its scale).
at::Tensor sum_squares_cuda(const at::Tensor& x_in, int64_t dim) {
  const ReductionLayout l = reduction_layout(x_in, dim);
  TORCH_CHECK(x_in.is_cuda(), "col_sum_squares: expected a CUDA tensor");
  const auto acc_type = at::toOpMathType(x_in.scalar_type());
  if (x_in.numel() == 0) return at::zeros({l.d}, x_in.options().dtype(acc_type));
  const c10::cuda::CUDAGuard guard(x_in.device());
  const cudaStream_t stream = current_stream();
  const bool channels_last = channels_last_columns(x_in, dim);
  const at::Tensor x = channels_last ? x_in : x_in.contiguous();
  const int64_t target_blocks = 4 * sm_count();
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "col_sum_squares", [&] {
        using S = scalar_t;
        using T = at::opmath_type<S>;
        constexpr int V = static_cast<int>(16 / sizeof(S));
        const S* xp = x.const_data_ptr<S>();
        if (channels_last || l.inner == 1) {
          const int64_t rows = x.numel() / l.d;
          const bool vec = l.d % V == 0 && aligned(xp, V * sizeof(S));
          const int width = vec ? V : 1;
          const int64_t gx = ceil_div(l.d, kColsX * width);
          const int64_t gy =
              std::clamp<int64_t>(ceil_div(target_blocks, gx), 1,
                                  std::min<int64_t>(ceil_div(rows, 4 * kRowsY), 65535));
          at::Tensor partial = at::empty({gy, l.d}, x.options().dtype(acc_type));
          const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
          const dim3 block(kColsX, kRowsY);
          if (vec) {
            column_kernel<V, S, T>
                <<<grid, block, 0, stream>>>(xp, rows, l.d, partial.data_ptr<T>());
          } else {
            column_kernel<1, S, T>
                <<<grid, block, 0, stream>>>(xp, rows, l.d, partial.data_ptr<T>());
          }
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          out = total(partial);
        } else if (2 * l.inner <= kThreads) {
          const int inner = static_cast<int>(l.inner);
          const int64_t slices = kThreads / inner;
          const int64_t gy =
              std::clamp<int64_t>(ceil_div(target_blocks, l.d), 1,
                                  std::min<int64_t>(ceil_div(l.outer, slices), 65535));
          at::Tensor partial = at::empty({gy, l.d}, x.options().dtype(acc_type));
          const dim3 grid(static_cast<unsigned>(l.d), static_cast<unsigned>(gy));
          small_channel_kernel<S, T>
              <<<grid, kThreads, 0, stream>>>(xp, l.outer, l.d, inner, partial.data_ptr<T>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          out = total(partial);
        } else {
          const bool vec = l.inner % V == 0 && aligned(xp, V * sizeof(S));
          const int64_t gy = std::clamp<int64_t>(ceil_div(target_blocks, l.d), 1,
                                                 std::min<int64_t>(l.outer, 65535));
          at::Tensor partial = at::empty({gy, l.d}, x.options().dtype(acc_type));
          const dim3 grid(static_cast<unsigned>(l.d), static_cast<unsigned>(gy));
          if (vec) {
            channel_kernel<V, S, T>
                <<<grid, kThreads, 0, stream>>>(xp, l.outer, l.d, l.inner, partial.data_ptr<T>());
          } else {
            channel_kernel<1, S, T>
                <<<grid, kThreads, 0, stream>>>(xp, l.outer, l.d, l.inner, partial.data_ptr<T>());
          }
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          out = total(partial);
        }
      });
  return out;
}

// partial[split, c, p] = sum over the split's samples b of (mean_g x[b, g * Cg + c, p])^2,
// one thread per (c, p) position of the (Cg, H * W) plane. x is contiguous (NCHW) or
// channels-last (NHWC, read in place); consecutive threads take consecutive addresses of
// either layout.
template <typename S, typename T>
__global__ void __launch_bounds__(kThreads)
    group_mean_squares_kernel(const S* x, ConvGeometry g, int64_t per_split, bool channels_last,
                              T* partial) {
  const int64_t hw = g.H * g.W;
  const int64_t n = g.Cg * hw;
  const int64_t q = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (q >= n) return;
  int64_t c, pos, stride_c, stride_pos;
  if (channels_last) {
    pos = q / g.Cg;
    c = q - pos * g.Cg;
    stride_c = 1;
    stride_pos = g.C;
  } else {
    c = q / hw;
    pos = q - c * hw;
    stride_c = hw;
    stride_pos = 1;
  }
  const int64_t stride_b = g.C * hw;
  const int64_t b0 = static_cast<int64_t>(blockIdx.y) * per_split;
  const int64_t b1 = min(g.B, b0 + per_split);
  const T inv_groups = T(1) / static_cast<T>(g.groups);
  T acc = T(0);
  for (int64_t b = b0; b < b1; ++b) {
    T mean = T(0);
    for (int64_t grp = 0; grp < g.groups; ++grp) {
      mean += static_cast<T>(x[b * stride_b + (grp * g.Cg + c) * stride_c + pos * stride_pos]);
    }
    if (g.groups > 1) mean *= inv_groups;
    acc += mean * mean;
  }
  partial[blockIdx.y * n + c * hw + pos] = acc;
}

// out[t], t = (c * kh + i) * kw + j: sum of sq[c] over the input positions that kernel
// offset (i, j) visits; one block per t.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    window_sums_kernel(const T* sq, ConvGeometry g, T* out) {
  const int64_t t = blockIdx.x;
  const int64_t c = t / (g.kh * g.kw);
  const int64_t i = (t / g.kw) % g.kh;
  const int64_t j = t % g.kw;
  int64_t oh0, oh1, ow0, ow1;
  valid_outputs(g.H, g.OH, g.sh, g.ph, i, g.dh, &oh0, &oh1);
  valid_outputs(g.W, g.OW, g.sw, g.pw, j, g.dw, &ow0, &ow1);
  const int64_t nw = ow1 - ow0;
  const int64_t count = (oh1 - oh0) * nw;
  const T* plane = sq + c * g.H * g.W;
  T acc = T(0);
  for (int64_t k = threadIdx.x; k < count; k += kThreads) {
    const int64_t oh = oh0 + k / nw;
    const int64_t ow = ow0 + k % nw;
    acc += plane[(oh * g.sh + i * g.dh - g.ph) * g.W + ow * g.sw + j * g.dw - g.pw];
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) out[t] = acc;
}

at::Tensor conv2d_patch_sum_squares_cuda(const at::Tensor& x_in, at::IntArrayRef kernel_size,
                                         at::IntArrayRef stride, at::IntArrayRef padding,
                                         at::IntArrayRef dilation, int64_t groups) {
  const ConvGeometry g = conv_geometry(x_in, kernel_size, stride, padding, dilation, groups);
  TORCH_CHECK(x_in.is_cuda(), "conv2d_patch_sum_squares: expected a CUDA tensor");
  const auto acc_type = at::toOpMathType(x_in.scalar_type());
  at::Tensor out = at::zeros({g.Cg * g.kh * g.kw}, x_in.options().dtype(acc_type));
  if (x_in.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(x_in.device());
  const cudaStream_t stream = current_stream();
  const bool channels_last =
      !x_in.is_contiguous() && x_in.is_contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor x = channels_last ? x_in : x_in.contiguous();
  const int64_t n = g.Cg * g.H * g.W;
  const int64_t blocks = ceil_div(n, kThreads);
  const int64_t splits_wanted =
      std::clamp<int64_t>(ceil_div(8 * sm_count(), blocks), 1, std::min<int64_t>(g.B, 65535));
  const int64_t per_split = ceil_div(g.B, splits_wanted);
  const int64_t splits = ceil_div(g.B, per_split);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "conv2d_patch_sum_squares", [&] {
        using S = scalar_t;
        using T = at::opmath_type<S>;
        at::Tensor partial = at::empty({splits, g.Cg, g.H, g.W}, x.options().dtype(acc_type));
        const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(splits));
        group_mean_squares_kernel<S, T><<<grid, kThreads, 0, stream>>>(
            x.const_data_ptr<S>(), g, per_split, channels_last, partial.data_ptr<T>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        const at::Tensor sq = total(partial).contiguous();
        window_sums_kernel<T><<<static_cast<unsigned>(out.numel()), kThreads, 0, stream>>>(
            sq.const_data_ptr<T>(), g, out.data_ptr<T>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return out;
}

// col_sum_squares: the sums, then times `scale` if given, as an ATen multiply (each product
// rounded once, as the reference's).
at::Tensor col_sum_squares_cuda(const at::Tensor& x, int64_t dim,
                                const std::optional<at::Tensor>& scale) {
  const ReductionLayout l = reduction_layout(x, dim);
  check_result_scale("col_sum_squares", scale, l.d, at::toOpMathType(x.scalar_type()),
                     x.device());
  at::Tensor out = sum_squares_cuda(x, dim);
  if (scale.has_value()) out.mul_(*scale);
  return out;
}

// input_sum_squares: col_sum_squares's kernel, then the reference's multiplies by 1/N and the
// weight and its bias entry, and by `scale` if given, as ATen ops (each product rounded once,
// as there).
at::Tensor input_sum_squares_cuda(const at::Tensor& x, double weight, bool bias,
                                  const std::optional<at::Tensor>& scale) {
  const InputRows r = input_rows(x);
  check_result_scale("input_sum_squares", scale, r.d + (bias ? 1 : 0),
                     at::toOpMathType(x.scalar_type()), x.device());
  at::Tensor h = sum_squares_cuda(x, -1);
  h.mul_(r.scale).mul_(weight);
  if (bias) {
    at::Tensor entry = at::full({1}, static_cast<double>(r.rows), h.options());
    entry.mul_(r.scale).mul_(weight);
    h = at::cat({h, entry});
  }
  if (scale.has_value()) h.mul_(*scale);
  return h;
}

}  // namespace
}  // namespace singd::cuda

TORCH_LIBRARY_IMPL(singd_cuda, CUDA, m) {
  m.impl("col_sum_squares", &singd::cuda::col_sum_squares_cuda);
  m.impl("input_sum_squares", &singd::cuda::input_sum_squares_cuda);
  m.impl("conv2d_patch_sum_squares", &singd::cuda::conv2d_patch_sum_squares_cuda);
}
