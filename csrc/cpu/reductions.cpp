// CPU kernels of the statistics reductions: col_sum_squares (sum of x^2 over every dimension
// but one) and conv2d_patch_sum_squares (diagonal of a^T a for the unfolded, group-averaged
// convolution input, without unfolding). Accumulation in the op-math type (float, or double
// for float64); work is split in a fixed way that does not depend on the thread count, so
// results are reproducible.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../op_checks.h"
#include "vector_isa.h"

namespace singd {
namespace {

constexpr int64_t kLanes = 16;       // independent accumulators of a contiguous sum
constexpr int64_t kBlockCols = 256;  // columns per task of the column reduction
constexpr int64_t kBlockRows = 64;   // rows summed before adding into the running total
constexpr int64_t kWork = 1 << 16;   // elements per task, roughly

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// sum_i x_i^2 over a contiguous run, in kLanes lanes (vectorisable without reassociation).
template <typename S, typename T>
SINGD_CPU_CLONES T run_sum_squares(const S* x, int64_t n) {
  T lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const T v = static_cast<T>(x[i + l]);
      lane[l] += v * v;
    }
  }
  for (; i < n; ++i) {
    const T v = static_cast<T>(x[i]);
    lane[0] += v * v;
  }
  T total = T(0);
  for (int64_t l = 0; l < kLanes; ++l) total += lane[l];
  return total;
}

// block[c] += x[r, c0 + c]^2 for rows r0 <= r < r1, c < w, of x (rows, d) row-major.
template <typename S, typename T>
SINGD_CPU_CLONES void add_column_squares(const S* x, int64_t d, int64_t r0, int64_t r1,
                                         int64_t c0, int64_t w, T* block) {
  for (int64_t r = r0; r < r1; ++r) {
    const S* row = x + r * d + c0;
    for (int64_t c = 0; c < w; ++c) {
      const T v = static_cast<T>(row[c]);
      block[c] += v * v;
    }
  }
}

// x (rows, d) row-major: out[c] = sum_r x[r, c]^2. Tasks are (row block, column block);
// row blocks write partial sums that are added in a fixed order.
template <typename S, typename T>
void column_sum_squares(const S* x, int64_t rows, int64_t d, T* out) {
  const int64_t n_cb = ceil_div(d, kBlockCols);
  const int64_t n_rb = std::clamp<int64_t>(rows * d / kWork, 1, std::min<int64_t>(rows, 64));
  const int64_t rows_per = ceil_div(rows, n_rb);
  std::vector<T> partial(static_cast<size_t>(n_rb * d), T(0));
  at::parallel_for(0, n_rb * n_cb, 1, [&](int64_t lo, int64_t hi) {
    T total[kBlockCols];
    T block[kBlockCols];
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t rb = task / n_cb;
      const int64_t c0 = (task % n_cb) * kBlockCols;
      const int64_t w = std::min(kBlockCols, d - c0);
      const int64_t r_end = std::min(rows, (rb + 1) * rows_per);
      std::fill(total, total + w, T(0));
      for (int64_t r0 = rb * rows_per; r0 < r_end; r0 += kBlockRows) {
        std::fill(block, block + w, T(0));
        add_column_squares(x, d, r0, std::min(r_end, r0 + kBlockRows), c0, w, block);
        for (int64_t c = 0; c < w; ++c) total[c] += block[c];
      }
      std::copy(total, total + w, partial.data() + rb * d + c0);
    }
  });
  for (int64_t rb = 0; rb < n_rb; ++rb) {
    for (int64_t c = 0; c < d; ++c) out[c] += partial[rb * d + c];
  }
}

// x (outer, d, inner) contiguous: out[c] = sum_{o, k} x[o, c, k]^2, one task per channel.
template <typename S, typename T>
void channel_sum_squares(const S* x, int64_t outer, int64_t d, int64_t inner, T* out) {
  at::parallel_for(0, d, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      T total = T(0);
      for (int64_t o = 0; o < outer; ++o) {
        total += run_sum_squares<S, T>(x + (o * d + c) * inner, inner);
      }
      out[c] = total;
    }
  });
}

// out[c] = out[c] * scale[c]: each product rounded once in T, as a separate multiply by the
// vector rounds.
template <typename T>
SINGD_CPU_CLONES void scale_entries(T* out, const T* scale, int64_t n) {
  for (int64_t c = 0; c < n; ++c) out[c] = out[c] * scale[c];
}

template <typename T>
void apply_scale(const std::optional<at::Tensor>& scale, at::Tensor& out) {
  if (!scale.has_value()) return;
  const at::Tensor s = scale->contiguous();
  scale_entries(out.data_ptr<T>(), s.const_data_ptr<T>(), out.numel());
}

at::Tensor col_sum_squares_cpu(const at::Tensor& x_in, int64_t dim,
                               const std::optional<at::Tensor>& scale) {
  const ReductionLayout l = reduction_layout(x_in, dim);
  at::Tensor out = at::zeros({l.d}, x_in.options().dtype(at::toOpMathType(x_in.scalar_type())));
  check_result_scale("col_sum_squares", scale, l.d, out.scalar_type(), out.device());
  if (x_in.numel() == 0) {
    if (scale.has_value()) out.mul_(*scale);  // (0 * a nan scale entry is a nan)
    return out;
  }
  const at::Tensor x = x_in.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "col_sum_squares", [&] {
        using T = at::opmath_type<scalar_t>;
        const scalar_t* xp = x.const_data_ptr<scalar_t>();
        if (l.inner == 1) {
          column_sum_squares(xp, l.outer, l.d, out.data_ptr<T>());
        } else {
          channel_sum_squares(xp, l.outer, l.d, l.inner, out.data_ptr<T>());
        }
        apply_scale<T>(scale, out);
      });
  return out;
}

// input_sum_squares: the column sums of x (rows, d), then out[c] = (sum_c * 1/N) * weight and,
// with a bias, out[d] = (N * 1/N) * weight, then times `scale` if given: every product rounded
// once in the op-math type, as the reference's separate multiplies by the scalars 1/N and
// weight and by the vector round.
at::Tensor input_sum_squares_cpu(const at::Tensor& x_in, double weight, bool bias,
                                 const std::optional<at::Tensor>& scale) {
  const InputRows r = input_rows(x_in);
  const auto acc_type = at::toOpMathType(x_in.scalar_type());
  at::Tensor out = at::zeros({r.d + (bias ? 1 : 0)}, x_in.options().dtype(acc_type));
  check_result_scale("input_sum_squares", scale, out.numel(), acc_type, out.device());
  const at::Tensor x = x_in.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "input_sum_squares", [&] {
        using T = at::opmath_type<scalar_t>;
        T* o = out.data_ptr<T>();
        if (x.numel() > 0) column_sum_squares(x.const_data_ptr<scalar_t>(), r.rows, r.d, o);
        const T inv_rows = static_cast<T>(r.scale);
        const T w = static_cast<T>(weight);
        for (int64_t c = 0; c < r.d; ++c) o[c] = o[c] * inv_rows * w;
        if (bias) o[r.d] = static_cast<T>(static_cast<double>(r.rows)) * inv_rows * w;
        apply_scale<T>(scale, out);
      });
  return out;
}

// S[c, h, w] = sum_b (mean_g x[b, g * Cg + c, h, w])^2 over a block of positions.
template <typename S, typename T>
void group_mean_squares(const S* x, const ConvGeometry& g, T* sq) {
  const int64_t hw = g.H * g.W;
  const int64_t n_blocks = ceil_div(hw, kBlockCols);
  const T inv_groups = T(1) / static_cast<T>(g.groups);
  at::parallel_for(0, g.Cg * n_blocks, 1, [&](int64_t lo, int64_t hi) {
    T mean[kBlockCols];
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t c = task / n_blocks;
      const int64_t p0 = (task % n_blocks) * kBlockCols;
      const int64_t w = std::min(kBlockCols, hw - p0);
      T* acc = sq + c * hw + p0;
      for (int64_t b = 0; b < g.B; ++b) {
        std::fill(mean, mean + w, T(0));
        for (int64_t grp = 0; grp < g.groups; ++grp) {
          const S* src = x + ((b * g.C) + grp * g.Cg + c) * hw + p0;
          for (int64_t q = 0; q < w; ++q) mean[q] += static_cast<T>(src[q]);
        }
        if (g.groups > 1) {
          for (int64_t q = 0; q < w; ++q) mean[q] *= inv_groups;
        }
        for (int64_t q = 0; q < w; ++q) acc[q] += mean[q] * mean[q];
      }
    }
  });
}

// out[(c * kh + i) * kw + j] = sum over valid output positions of sq[c, h(i), w(j)].
template <typename T>
void window_sums(const T* sq, const ConvGeometry& g, T* out) {
  at::parallel_for(0, g.Cg * g.kh * g.kw, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t c = t / (g.kh * g.kw);
      const int64_t i = (t / g.kw) % g.kh;
      const int64_t j = t % g.kw;
      int64_t oh0, oh1, ow0, ow1;
      valid_outputs(g.H, g.OH, g.sh, g.ph, i, g.dh, &oh0, &oh1);
      valid_outputs(g.W, g.OW, g.sw, g.pw, j, g.dw, &ow0, &ow1);
      const T* plane = sq + c * g.H * g.W;
      T total = T(0);
      for (int64_t oh = oh0; oh < oh1; ++oh) {
        const int64_t base = (oh * g.sh + i * g.dh - g.ph) * g.W + (j * g.dw - g.pw);
        T row_total = T(0);
        for (int64_t ow = ow0; ow < ow1; ++ow) row_total += plane[base + ow * g.sw];
        total += row_total;
      }
      out[t] = total;
    }
  });
}

at::Tensor conv2d_patch_sum_squares_cpu(const at::Tensor& x_in, at::IntArrayRef kernel_size,
                                        at::IntArrayRef stride, at::IntArrayRef padding,
                                        at::IntArrayRef dilation, int64_t groups) {
  const ConvGeometry g = conv_geometry(x_in, kernel_size, stride, padding, dilation, groups);
  const auto acc_type = at::toOpMathType(x_in.scalar_type());
  at::Tensor out = at::zeros({g.Cg * g.kh * g.kw}, x_in.options().dtype(acc_type));
  if (x_in.numel() == 0) return out;
  const at::Tensor x = x_in.contiguous();
  at::Tensor sq = at::zeros({g.Cg, g.H, g.W}, x_in.options().dtype(acc_type));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "conv2d_patch_sum_squares", [&] {
        using T = at::opmath_type<scalar_t>;
        group_mean_squares(x.const_data_ptr<scalar_t>(), g, sq.data_ptr<T>());
        window_sums(sq.const_data_ptr<T>(), g, out.data_ptr<T>());
      });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(singd_cuda, CPU, m) {
  m.impl("col_sum_squares", &col_sum_squares_cpu);
  m.impl("input_sum_squares", &input_sum_squares_cpu);
  m.impl("conv2d_patch_sum_squares", &conv2d_patch_sum_squares_cpu);
}

}  // namespace singd
