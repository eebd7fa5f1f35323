// CPU kernel of min_max_normalise_rows_: every row of v scaled to [0, 1] into out, by the
// row's minimum and span (singd_math.h's min_max_scale), each operation rounded once in
// out's dtype as the reference's aminmax, sub, sign, add, clamp_min and div round it.
// Rows are independent, so splitting them over threads changes no result.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "../op_checks.h"

namespace singd {
namespace {

constexpr int64_t kWork = 1 << 15;  // elements per task, roughly

// One row: out[j] = v[j] in T, its minimum and maximum (NaN when it holds a NaN), then
// out[j] = min_max_element(out[j]).
template <typename S, typename T>
void normalise_row(const S* v, T* out, int64_t d) {
  T low = std::numeric_limits<T>::infinity();
  T high = -low;
  bool nan = false;
  for (int64_t j = 0; j < d; ++j) {
    const T x = static_cast<T>(v[j]);
    out[j] = x;
    nan = nan || x != x;
    low = x < low ? x : low;
    high = x > high ? x : high;
  }
  if (nan) low = high = std::numeric_limits<T>::quiet_NaN();
  const RowScale<T> scale = min_max_scale(low, high);
  for (int64_t j = 0; j < d; ++j) out[j] = min_max_element(out[j], scale);
}

void min_max_normalise_rows_cpu(at::Tensor& out, const at::Tensor& v) {
  const NormaliseRows r = check_normalise_rows(out, v);
  if (r.rows == 0) return;
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "min_max_normalise_rows_", [&] {
    using T = scalar_t;
    T* o = out.data_ptr<T>();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, v.scalar_type(), "min_max_normalise_rows_", [&] {
          const scalar_t* x = v.const_data_ptr<scalar_t>();
          const int64_t grain = std::max<int64_t>(1, kWork / r.d);
          at::parallel_for(0, r.rows, grain, [&](int64_t lo, int64_t hi) {
            for (int64_t i = lo; i < hi; ++i) {
              normalise_row(x + i * r.v_stride, o + i * r.out_stride, r.d);
            }
          });
        });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(singd_cuda, CPU, m) {
  m.impl("min_max_normalise_rows_", &min_max_normalise_rows_cpu);
}

}  // namespace singd
