// Attention on the native device: the fused kernel the executor's device picks.
//
// torch's scaled_dot_product_attention is a composite that asks _fused_sdp_choice which
// kernel to run. On this device the question runs on meta (the fallback), whose answer
// is always "math": some 35 ops per layer and direction, and slower ones, where a CPU or
// a GPU runs one fused kernel. So once the session knows its executor's device
// (set_executor_device, from the welcome) the device asks the executor's own
// _fused_sdp_choice, once per argument layout (a DYN round trip, then cached), and calls
// the chosen kernel as torch's sdpa calls it on that device. The composite cannot be
// left to do it: it calls the CPU's flash kernel on every device but CUDA.
//
// Fused: 4-D inputs without grouped heads. On a GPU only the plain case: no mask, no
// dropout (a GPU's fused kernels return their random state as host tensors that their
// backward reads on the host, while the executor keeps every result on its device) and
// head dimensions that need no padding. Everything else runs the composite's math path.
//
// Under torch.compile the arguments are fake (dynamo's and AOT autograd's tracing): the
// executor is asked about empty device tensors of the same layout instead, so that a
// compiled graph takes the kernel eager steps take. Symbolic sizes take the math path.
#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention.h>
#include <ATen/ops/_scaled_dot_product_flash_attention.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/scaled_dot_product_attention_native.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "record.h"

namespace cumulus {
namespace {

// sdp::SDPBackend's values, as _fused_sdp_choice returns them.
constexpr int64_t kFlash = 1, kEfficient = 2, kCudnn = 3;

struct Choices {
  std::mutex mutex;
  std::map<std::vector<int64_t>, int64_t> by_layout;
};
Choices& choices() {
  static auto* c = new Choices();
  return *c;
}

void put_layout(std::vector<int64_t>& key, const at::Tensor& t) {
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.insert(key.end(), t.sizes().begin(), t.sizes().end());
  key.insert(key.end(), t.strides().begin(), t.strides().end());
  key.push_back(t.storage_offset());
}

// A tensor of torch.compile's tracing (a FakeTensor, a FunctionalTensor): a Python subclass,
// which real device tensors never are.
bool traced(const at::Tensor& t) { return t.key_set().has(c10::DispatchKey::Python); }

bool symbolic(const at::Tensor& t) { return t.unsafeGetTensorImpl()->has_symbolic_sizes_strides(); }

// An empty device tensor laid out as `t` (a traced one): all the executor's choice reads.
// Made outside torch.compile's Python modes, which would make it fake too.
at::Tensor empty_like_layout(const at::Tensor& t) {
  c10::impl::ExcludeDispatchKeyGuard no_modes(
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                           c10::DispatchKey::Functionalize, c10::DispatchKey::PreDispatch}));
  const auto nbytes = at::detail::computeStorageNbytes(t.sizes(), t.strides(), t.itemsize(),
                                                      t.storage_offset());
  const int64_t elements = static_cast<int64_t>(nbytes) / static_cast<int64_t>(t.itemsize());
  const auto options = at::TensorOptions().dtype(t.dtype()).device(c10::DeviceType::PrivateUse1, 0);
  return at::empty({elements}, options).as_strided(t.sizes(), t.strides(), t.storage_offset());
}

// The kernel the executor's device picks for these arguments (cached per layout).
int64_t executor_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const std::optional<at::Tensor>& mask, double dropout_p,
                        bool is_causal, std::optional<double> scale) {
  std::vector<int64_t> key;
  for (const at::Tensor* t : {&q, &k, &v}) put_layout(key, *t);
  if (mask.has_value()) put_layout(key, *mask);
  key.push_back(mask.has_value());
  key.push_back(is_causal);
  for (const double x : {dropout_p, scale.value_or(-1.0)}) {
    int64_t bits = 0;
    std::memcpy(&bits, &x, sizeof bits);
    key.push_back(bits);
  }
  Choices& c = choices();
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    auto found = c.by_layout.find(key);
    if (found != c.by_layout.end()) return found->second;
  }
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::_fused_sdp_choice", "");
  auto real = [](const at::Tensor& t) { return traced(t) ? empty_like_layout(t) : t; };
  c10::IValue mask_arg = mask.has_value() ? c10::IValue(real(*mask)) : c10::IValue();
  c10::IValue scale_arg = scale.has_value() ? c10::IValue(*scale) : c10::IValue();
  const int64_t choice = run_on_executor(op, {real(q), real(k), real(v), mask_arg, dropout_p,
                                              is_causal, scale_arg, false})[0]
                             .toInt();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.by_layout.emplace(std::move(key), choice);
  return choice;
}

// Whether the executor is asked: 4-D inputs without grouped heads; on a GPU, also no
// mask, no dropout and head dimensions that need no padding (see the top of the file).
bool fusable(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
             const std::optional<at::Tensor>& mask, double dropout_p, bool enable_gqa) {
  const Executor on = executor_device();
  if (on == Executor::Unknown || enable_gqa) return false;
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return false;
  if (symbolic(q) || symbolic(k) || symbolic(v) || (mask && symbolic(*mask))) return false;
  if (on == Executor::Cpu) return true;
  return !mask.has_value() && dropout_p == 0.0 && q.size(-1) % 8 == 0 && v.size(-1) % 8 == 0;
}

// A boolean mask as the fused kernels take it, made as torch's composite makes it:
// 0 where attending, -inf where not, in the query's dtype.
std::optional<at::Tensor> additive(const std::optional<at::Tensor>& mask,
                                   const at::Tensor& q) {
  if (!mask.has_value() || mask->scalar_type() != at::kBool) return mask;
  at::Tensor out = at::zeros_like(*mask, q.options());
  out.masked_fill_(mask->logical_not(), -std::numeric_limits<double>::infinity());
  return out;
}

// Whether the user's torch.nn.attention.sdpa_kernel (or torch.backends.cuda's switches)
// allows the kernel the executor picked; if not, math, rather than a second choice.
bool allowed(int64_t choice) {
  const auto& ctx = at::globalContext();
  switch (choice) {
    case kFlash:
      return ctx.userEnabledFlashSDP();
    case kEfficient:
      return ctx.userEnabledMemEfficientSDP();
    case kCudnn:
      return ctx.userEnabledCuDNNSDP();
    default:
      return false;
  }
}

at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                std::optional<double> scale, bool enable_gqa) {
  const bool fused = fusable(q, k, v, mask, dropout_p, enable_gqa);
  const int64_t chosen = fused ? executor_choice(q, k, v, mask, dropout_p, is_causal, scale) : 0;
  const int64_t choice = allowed(chosen) ? chosen : 0;
  const bool lse = at::GradMode::is_enabled() &&
                   (q.requires_grad() || k.requires_grad() || v.requires_grad());
  if (choice != 0 && executor_device() == Executor::Cpu) {
    // A CPU has one fused kernel, which takes the mask and dropout as they are.
    return std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, additive(mask, q), scale));
  }
  switch (choice) {
    case kFlash:
      return std::get<0>(at::_scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal,
                                                                 false, scale));
    case kEfficient:
      return std::get<0>(at::_scaled_dot_product_efficient_attention(q, k, v, std::nullopt,
                                                                     lse, 0.0, is_causal, scale));
    case kCudnn:
      return std::get<0>(at::_scaled_dot_product_cudnn_attention(q, k, v, std::nullopt, lse,
                                                                 0.0, is_causal, false, scale));
    default:
      return at::native::scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal,
                                                       scale, enable_gqa);
  }
}

}  // namespace

void forget_attention_choices() {
  Choices& c = choices();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.by_layout.clear();
}

}  // namespace cumulus

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("scaled_dot_product_attention", cumulus::sdpa);
}
