// Dropout on the native device draws as the executor's device does.
//
// torch's composite `dropout` takes the fused `native_dropout` kernel on CUDA and on any
// PrivateUse1 device, and `bernoulli_` then a multiply on a CPU. The two draw different
// masks from the same seed. So with an executor on a CPU (set_executor_device) the
// device runs the CPU's steps, and a seeded model trains exactly as it does locally; on
// a GPU it keeps the fused kernel, as CUDA does.
#include <ATen/ops/dropout_native.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "record.h"

namespace cumulus {
namespace {

// The CPU's path (ATen's _dropout_impl for plain dropout), op for op.
at::Tensor cpu_dropout(const at::Tensor& input, double p) {
  if (p == 1) return input.mul(at::zeros({}, input.options()));
  at::Tensor noise = at::empty_like(input);
  noise.bernoulli_(1 - p);
  noise.div_(1 - p);
  return input.mul(noise);
}

at::Tensor autograd_dropout(const at::Tensor& input, double p, bool train) {
  TORCH_CHECK(p >= 0 && p <= 1, "dropout probability has to be between 0 and 1, but got ", p);
  if (executor_device() != Executor::Cpu) return at::native::dropout(input, p, train);
  if (p == 0 || !train || input.sym_numel() == 0) return input;
  return cpu_dropout(input, p);
}

}  // namespace
}  // namespace cumulus

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("dropout", cumulus::autograd_dropout);
}
