// Mixed precision on the native device: torch.autocast("cumulus") casts as CUDA's does.
//
// Autocast runs at the AutocastPrivateUse1 key, above the device's kernels: without a
// kernel there, even a plain fill_ fails in an autocast region. Every op falls through,
// except those of torch's own policy lists (the ones its CUDA registration uses):
// matmuls and convolutions in the region's dtype; numerically sensitive pointwise ops,
// norms and losses in float32; mixed-type ops promoted to the widest type. The casts
// are ops like any other: recorded, replayed on the executor.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace {
using namespace at::autocast;

#define CUMULUS_LOWER_PRECISION(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define CUMULUS_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define CUMULUS_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define CUMULUS_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  AT_FORALL_LOWER_PRECISION_FP(CUMULUS_LOWER_PRECISION)
  AT_FORALL_FP32(CUMULUS_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(CUMULUS_FP32_SET_OPT_DTYPE)
  AT_FORALL_PROMOTE(CUMULUS_PROMOTE)
}

}  // namespace
