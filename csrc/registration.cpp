// Schemas of the singd_cuda ops. The CPU kernels live in csrc/cpu, the CUDA kernels in
// csrc/cuda, the fake (meta) implementations in singd_cuda/ops/_fake.py, and the Python
// wrappers with their documentation in singd_cuda/ops/__init__.py.
#include <torch/library.h>

TORCH_LIBRARY(singd_cuda, m) {
  m.set_python_module("singd_cuda.ops._fake");
  m.def(
      "sgd_epilogue_(Tensor(a!)[] params, Tensor[] updates, Tensor(b!)[] momentum_bufs, "
      "float lr, float momentum, float weight_decay, bool decoupled, Tensor? inv_scale, "
      "Tensor? found_inf, bool stochastic_rounding, int seed) -> ()");
  m.def(
      "adam_epilogue_(Tensor(a!)[] params, Tensor[] updates, Tensor(b!)[] exp_avgs, "
      "float lr, float beta, int step, float weight_decay, bool decoupled, Tensor? inv_scale, "
      "Tensor? found_inf, bool stochastic_rounding, int seed) -> ()");
  m.def(
      "diag_precond_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] bufs, "
      "Tensor[] row_scales, Tensor[] col_scales, str variant, float lr, float momentum, "
      "float damping, float weight_decay, bool decoupled, int step, Tensor? inv_scale, "
      "Tensor? found_inf, bool stochastic_rounding, int seed) -> ()");
  m.def(
      "diag_factor_update_(Tensor(a!)[] k, Tensor(b!)[] m, Tensor[] h, Tensor[] a, "
      "Tensor[] b, float alpha1, float beta1, float damping) -> ()");
  m.def("min_max_normalise_rows_(Tensor(a!) out, Tensor v) -> ()");
  m.def("col_sum_squares(Tensor x, int dim=-1, Tensor? scale=None) -> Tensor");
  m.def(
      "input_sum_squares(Tensor x, float weight, bool bias, Tensor? scale=None) -> Tensor");
  m.def(
      "conv2d_patch_sum_squares(Tensor x, int[2] kernel_size, int[2] stride, int[2] padding, "
      "int[2] dilation, int groups) -> Tensor");
}
