// Host-side argument handling shared by the CPU and CUDA implementations: validation,
// hyperparameters -> Epilogue, in-place working copies, dtype dispatch.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "singd_math.h"

namespace singd {

inline bool is_floating(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// A vector of n entries stands for an (n, 1) or (1, n) matrix (a bias's gradient for its
// column): the same elements in the same row-major order.
inline bool vector_of_matrix(const at::Tensor& t, const at::Tensor& p) {
  return t.dim() == 1 && p.dim() == 2 && (p.size(0) == 1 || p.size(1) == 1) &&
         t.numel() == p.numel();
}

// Companion tensors (gradients, state) hold the parameter's shape (or, where `vector_ok`,
// for a one-column or one-row matrix its vector) and its dtype or float32.
inline void check_companion(const char* op, const char* what, const at::Tensor& p,
                            const at::Tensor& t, size_t i, bool vector_ok) {
  TORCH_CHECK(t.sizes() == p.sizes() || (vector_ok && vector_of_matrix(t, p)), op, ": ", what,
              "[", i, "] has shape ", t.sizes(), ", expected ", p.sizes());
  TORCH_CHECK(t.scalar_type() == p.scalar_type() || t.scalar_type() == at::kFloat, op, ": ", what,
              "[", i, "] has dtype ", t.scalar_type(), ", expected ", p.scalar_type(), " or Float");
  TORCH_CHECK(t.device() == p.device(), op, ": ", what, "[", i, "] is on ", t.device(),
              ", expected ", p.device());
}

// params[i] floating, all on one device; every list in `companions` as long as params (the
// one named `optional_name` may instead be empty), with params' shapes (the one named
// `vector_name` may hold a one-column or one-row matrix's vector) and devices and the dtype
// of params[i] or float32.
inline void check_lists(const char* op, at::TensorList params,
                        std::initializer_list<std::pair<const char*, at::TensorList>> companions,
                        const char* optional_name = nullptr, const char* vector_name = nullptr) {
  for (const auto& [name, list] : companions) {
    const bool may_be_empty = optional_name != nullptr && std::string_view(name) == optional_name;
    TORCH_CHECK(list.size() == params.size() || (may_be_empty && list.empty()), op, ": ", name,
                " has ", list.size(), " tensors, expected ", params.size());
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(is_floating(p.scalar_type()), op, ": tensor [", i, "] has dtype ", p.scalar_type(),
                ", expected a floating dtype");
    TORCH_CHECK(p.device() == params[0].device(), op, ": tensor [", i, "] is on ", p.device(),
                ", expected ", params[0].device());
    for (const auto& [name, list] : companions) {
      const bool vector_ok = vector_name != nullptr && std::string_view(name) == vector_name;
      if (!list.empty()) check_companion(op, name, p, list[i], i, vector_ok);
    }
  }
}

// A one-element floating tensor on `device` (loss-scale inverse, found_inf, traces).
inline void check_scalar_tensor(const char* op, const char* what, const at::Tensor& t,
                                const at::Device& device) {
  TORCH_CHECK(t.numel() == 1, op, ": ", what, " must have one element, got ", t.numel());
  TORCH_CHECK(is_floating(t.scalar_type()), op, ": ", what, " has dtype ", t.scalar_type(),
              ", expected a floating dtype");
  TORCH_CHECK(t.device() == device, op, ": ", what, " is on ", t.device(), ", expected ", device);
}

inline void check_optional_scalars(const char* op, const std::optional<at::Tensor>& inv_scale,
                                   const std::optional<at::Tensor>& found_inf,
                                   const at::Device& device) {
  if (inv_scale.has_value()) check_scalar_tensor(op, "inv_scale", *inv_scale, device);
  if (found_inf.has_value()) check_scalar_tensor(op, "found_inf", *found_inf, device);
}

// Hyperparameters of one epilogue call, as the op received them.
struct Hyper {
  double lr = 0.0;
  double momentum = 0.0;  // SGD momentum, or beta of the Adam form
  double weight_decay = 0.0;
  double damping = 0.0;
  bool decoupled = false;
  bool adam = false;  // Adam-style (bias-corrected EMA) instead of SGD momentum
  int64_t step = 1;
};

inline void check_adam(const char* op, const Hyper& h) {
  TORCH_CHECK(h.step >= 1, op, ": step must be >= 1, got ", h.step);
  TORCH_CHECK(h.momentum >= 0.0 && h.momentum < 1.0, op, ": beta must be in [0, 1), got ",
              h.momentum);
}

// The Epilogue in accumulation type T; scalars are rounded to T once, here, exactly as
// PyTorch rounds a Python float multiplying a tensor of dtype T. inv_scale is 1 when absent
// (the CUDA kernels read the actual value on the device).
template <typename T>
Epilogue<T> make_epilogue(const Hyper& h, double inv_scale) {
  Epilogue<T> e{};
  e.inv_scale = static_cast<T>(inv_scale);
  e.wd_coupled = static_cast<T>(h.decoupled ? 0.0 : h.weight_decay);
  e.p_scale = static_cast<T>(h.decoupled ? 1.0 - h.lr * h.weight_decay : 1.0);
  e.lr = static_cast<T>(h.lr);
  e.momentum = static_cast<T>(h.momentum);
  e.one_minus_beta = static_cast<T>(1.0 - h.momentum);
  e.step_size = static_cast<T>(
      h.adam ? h.lr / (1.0 - std::pow(h.momentum, static_cast<double>(h.step))) : h.lr);
  e.damping = static_cast<T>(h.damping);
  return e;
}

// Working copy of a tensor written in place: the tensor itself when contiguous, else a
// contiguous copy that commit() writes back.
class InPlace {
 public:
  explicit InPlace(const at::Tensor& t) : target_(t), work_(t.contiguous()) {}
  // ``contiguous`` false: the tensor itself whatever its strides (for a kernel that
  // reads it where it lies, e.g. by rows)
  InPlace(const at::Tensor& t, bool contiguous)
      : target_(t), work_(contiguous ? t.contiguous() : t) {}
  const at::Tensor& work() const { return work_; }
  void commit() {
    if (!work_.is_same(target_)) target_.copy_(work_);
  }

 private:
  at::Tensor target_;
  at::Tensor work_;
};

inline std::vector<InPlace> in_place(at::TensorList list) {
  std::vector<InPlace> out;
  out.reserve(list.size());
  for (const auto& t : list) out.emplace_back(t);
  return out;
}

inline void commit_all(std::vector<InPlace>& list) {
  for (auto& t : list) t.commit();
}

// The stride of dim 0 when every slice t[r] is contiguous (a row-major matrix with a row
// stride, e.g. M[:, :-1]; a strided vector, e.g. M[:, -1], whose slices are elements),
// else -1. Contiguous tensors give their own dim-0 stride.
inline int64_t contiguous_rows_stride(const at::Tensor& t) {
  if (t.dim() == 0 || t.size(0) == 0) return t.is_contiguous() ? 1 : -1;
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) return -1;
    expected *= t.size(d);
  }
  return t.size(0) == 1 ? expected : t.stride(0);
}

inline std::vector<at::Tensor> contiguous(at::TensorList list) {
  std::vector<at::Tensor> out;
  out.reserve(list.size());
  for (const auto& t : list) out.push_back(t.contiguous());
  return out;
}

// ---- op-specific argument checks --------------------------------------------------------

// diag_precond_step_ mode: "singd" (SGD momentum on c_i^2 k_j^2 g_ij) or "adafisher".
inline bool parse_adafisher_mode(std::string_view mode) {
  TORCH_CHECK(mode == "singd" || mode == "adafisher",
              "diag_precond_step_: mode must be 'singd' or 'adafisher', got '", mode, "'");
  return mode == "adafisher";
}

// params[i] 2-D (d_C, n_i); row_scales[i] d_C entries, col_scales[i] n_i entries.
inline void check_scales(at::TensorList params, at::TensorList row_scales,
                         at::TensorList col_scales) {
  const char* op = "diag_precond_step_";
  TORCH_CHECK(row_scales.size() == params.size() && col_scales.size() == params.size(), op,
              ": expected one row_scale and one col_scale per parameter");
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.dim() == 2, op, ": params[", i, "] must be 2-D (d_C, n), got ", p.sizes());
    TORCH_CHECK(row_scales[i].numel() == p.size(0), op, ": row_scales[", i, "] has ",
                row_scales[i].numel(), " entries, expected ", p.size(0));
    TORCH_CHECK(col_scales[i].numel() == p.size(1), op, ": col_scales[", i, "] has ",
                col_scales[i].numel(), " entries, expected ", p.size(1));
    for (const auto* s : {&row_scales[i], &col_scales[i]}) {
      TORCH_CHECK(is_floating(s->scalar_type()) && s->device() == p.device(), op,
                  ": scales must be floating tensors on ", p.device());
    }
  }
}

// Scale vectors in the accumulation dtype of params[i], flat and contiguous (a copy only
// when they are not already; one that is already is returned as it is, without the
// reshape's view: two per parameter and step otherwise).
inline at::Tensor as_scale(const at::Tensor& s, at::ScalarType param_type) {
  const auto acc = at::toOpMathType(param_type);
  if (s.dim() == 1 && s.scalar_type() == acc && s.is_contiguous()) return s;
  return s.reshape({-1}).to(acc).contiguous();
}

// a and b of diag_factor_update_: empty (all ones) or one single-element tensor per factor.
inline void check_traces(at::TensorList k, at::TensorList a, const char* name) {
  TORCH_CHECK(a.empty() || a.size() == k.size(), "diag_factor_update_: ", name, " has ", a.size(),
              " tensors, expected 0 or ", k.size());
  for (size_t i = 0; i < a.size(); ++i) {
    check_scalar_tensor("diag_factor_update_", name, a[i], k[i].device());
  }
}

// x viewed as (outer, d, inner) around dimension dim.
struct ReductionLayout {
  int64_t outer;
  int64_t d;
  int64_t inner;
};

inline ReductionLayout reduction_layout(const at::Tensor& x, int64_t dim) {
  TORCH_CHECK(x.dim() >= 1, "col_sum_squares: x must have at least one dimension");
  TORCH_CHECK(is_floating(x.scalar_type()), "col_sum_squares: x has dtype ", x.scalar_type(),
              ", expected a floating dtype");
  const int64_t w = at::maybe_wrap_dim(dim, x.dim());
  ReductionLayout l{1, x.size(w), 1};
  for (int64_t i = 0; i < w; ++i) l.outer *= x.size(i);
  for (int64_t i = w + 1; i < x.dim(); ++i) l.inner *= x.size(i);
  return l;
}

// The optional `scale` of a statistics reduction whose result has n entries of dtype
// `dtype` on `device`: a vector of n entries of that dtype and device, multiplied into the
// result elementwise.
inline void check_result_scale(const char* op, const std::optional<at::Tensor>& scale,
                               int64_t n, at::ScalarType dtype, const at::Device& device) {
  if (!scale.has_value()) return;
  const at::Tensor& s = *scale;
  TORCH_CHECK(s.dim() == 1 && s.numel() == n, op, ": scale must be a vector of ", n,
              " entries (one per result entry), got shape ", s.sizes());
  TORCH_CHECK(s.scalar_type() == dtype, op, ": scale has dtype ", s.scalar_type(),
              ", expected the result's ", dtype, " (convert it with .to(", dtype, "))");
  TORCH_CHECK(s.device() == device, op, ": scale is on ", s.device(), ", expected ", device);
}

// A Linear layer's input x (..., d) as N = numel / d rows of d, and the scale 1/N (1 when
// there are no rows) of input_sum_squares.
struct InputRows {
  int64_t rows;
  int64_t d;
  double scale;
};

inline InputRows input_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "input_sum_squares: x must have at least one dimension");
  TORCH_CHECK(is_floating(x.scalar_type()), "input_sum_squares: x has dtype ", x.scalar_type(),
              ", expected a floating dtype");
  const int64_t d = x.size(-1);
  const int64_t rows = x.numel() / std::max<int64_t>(d, 1);
  return {rows, d, 1.0 / static_cast<double>(std::max<int64_t>(rows, 1))};
}

// Geometry of conv2d_patch_sum_squares: x (B, C, H, W), C = groups * Cg, output size (OH, OW).
struct ConvGeometry {
  int64_t B, C, H, W, groups, Cg;
  int64_t kh, kw, sh, sw, ph, pw, dh, dw;
  int64_t OH, OW;
};

inline ConvGeometry conv_geometry(const at::Tensor& x, at::IntArrayRef kernel_size,
                                  at::IntArrayRef stride, at::IntArrayRef padding,
                                  at::IntArrayRef dilation, int64_t groups) {
  const char* op = "conv2d_patch_sum_squares";
  TORCH_CHECK(x.dim() == 4, op, ": x must be 4-D (B, C, H, W), got ", x.sizes());
  TORCH_CHECK(is_floating(x.scalar_type()), op, ": x has dtype ", x.scalar_type(),
              ", expected a floating dtype");
  TORCH_CHECK(
      kernel_size.size() == 2 && stride.size() == 2 && padding.size() == 2 && dilation.size() == 2,
      op, ": kernel_size, stride, padding and dilation take two values each");
  TORCH_CHECK(groups >= 1 && x.size(1) % groups == 0, op, ": groups (", groups,
              ") must divide the channels (", x.size(1), ")");
  ConvGeometry g{
      x.size(0),      x.size(1),      x.size(2), x.size(3), groups,     x.size(1) / groups,
      kernel_size[0], kernel_size[1], stride[0], stride[1], padding[0], padding[1],
      dilation[0],    dilation[1],    0,         0};
  TORCH_CHECK(g.kh >= 1 && g.kw >= 1 && g.sh >= 1 && g.sw >= 1 && g.dh >= 1 && g.dw >= 1 &&
                  g.ph >= 0 && g.pw >= 0,
              op, ": kernel_size, stride and dilation must be >= 1 and padding >= 0");
  g.OH = (g.H + 2 * g.ph - g.dh * (g.kh - 1) - 1) / g.sh + 1;
  g.OW = (g.W + 2 * g.pw - g.dw * (g.kw - 1) - 1) / g.sw + 1;
  TORCH_CHECK(g.H + 2 * g.ph >= g.dh * (g.kh - 1) + 1 && g.W + 2 * g.pw >= g.dw * (g.kw - 1) + 1,
              op, ": the dilated kernel does not fit the padded input");
  return g;
}

// f(std::true_type) or f(std::false_type): a runtime flag as a compile-time constant.
template <typename F>
void with_bool(bool v, const F& f) {
  if (v) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// ---- dtype dispatch: parameter dtype P, companions of dtype P or float --------------------

template <typename T>
struct Tag {
  using type = T;
};

template <typename P, typename F>
void same_or_float(at::ScalarType t, F&& f) {
  if (t == c10::CppTypeToScalarType<P>::value) {
    f(Tag<P>{});
  } else {
    TORCH_CHECK(t == at::kFloat, "singd_cuda: unsupported companion dtype ", t);
    f(Tag<float>{});
  }
}

// f(Tag<P>, Tag<A>, Tag<B>) with P the parameter dtype and A, B each P or float.
template <typename F>
void dispatch_types(at::ScalarType p, at::ScalarType a, at::ScalarType b, F&& f) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p, "singd_cuda", [&] {
    using P = scalar_t;
    same_or_float<P>(a,
                     [&](auto ta) { same_or_float<P>(b, [&](auto tb) { f(Tag<P>{}, ta, tb); }); });
  });
}

// The rows of min_max_normalise_rows_'s out and v: (rows, d) or a (d,) vector as one row,
// equal shapes on one device, d > 0, each row contiguous (rows may lie apart), out
// float32 or float64.
struct NormaliseRows {
  int64_t rows, d, out_stride, v_stride;
};

inline NormaliseRows check_normalise_rows(const at::Tensor& out, const at::Tensor& v) {
  const char* op = "min_max_normalise_rows_";
  TORCH_CHECK(out.dim() == 1 || out.dim() == 2, op, ": expected a vector or a matrix, got ",
              out.dim(), " dimensions");
  TORCH_CHECK(out.sizes() == v.sizes(), op, ": out has shape ", out.sizes(), " but v ",
              v.sizes());
  TORCH_CHECK(out.device() == v.device(), op, ": out and v are on different devices");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble, op,
              ": out must be float32 or float64, got ", out.scalar_type());
  TORCH_CHECK(at::isFloatingType(v.scalar_type()), op, ": v must be floating, got ",
              v.scalar_type());
  const bool matrix = out.dim() == 2;
  const int64_t rows = matrix ? out.size(0) : 1;
  const int64_t d = out.size(-1);
  TORCH_CHECK(d > 0 || rows == 0, op, ": a row needs at least one element");
  TORCH_CHECK(out.stride(-1) == 1 || d <= 1, op, ": out's rows must be contiguous");
  TORCH_CHECK(v.stride(-1) == 1 || d <= 1, op, ": v's rows must be contiguous");
  return {rows, d, matrix ? out.stride(0) : d, matrix ? v.stride(0) : d};
}

}  // namespace singd
