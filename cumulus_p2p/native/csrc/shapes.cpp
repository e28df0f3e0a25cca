// C++ output shapes for the ops a training step runs most (see shapes.h for why).
#include "shapes.h"

#include <type_traits>
#include <unordered_map>

#include <ATen/EmptyTensor.h>
#include <ATen/ExpandUtils.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_log_softmax_backward_data_meta_dispatch.h>
#include <ATen/ops/_log_softmax_meta_dispatch.h>
#include <ATen/ops/_softmax_backward_data_meta_dispatch.h>
#include <ATen/ops/_softmax_meta_dispatch.h>
#include <ATen/ops/add_meta_dispatch.h>
#include <ATen/ops/addcdiv_meta_dispatch.h>
#include <ATen/ops/addcmul_meta_dispatch.h>
#include <ATen/ops/addmm_meta_dispatch.h>
#include <ATen/ops/all_meta_dispatch.h>
#include <ATen/ops/arange_meta_dispatch.h>
#include <ATen/ops/bmm_meta_dispatch.h>
#include <ATen/ops/cat_meta_dispatch.h>
#include <ATen/ops/div_meta_dispatch.h>
#include <ATen/ops/exp_meta_dispatch.h>
#include <ATen/ops/fill_meta_dispatch.h>
#include <ATen/ops/gelu_backward_meta_dispatch.h>
#include <ATen/ops/gelu_meta_dispatch.h>
#include <ATen/ops/isneginf_meta_dispatch.h>
#include <ATen/ops/lerp_meta_dispatch.h>
#include <ATen/ops/linalg_vector_norm_meta_dispatch.h>
#include <ATen/ops/mean_meta_dispatch.h>
#include <ATen/ops/mm_meta_dispatch.h>
#include <ATen/ops/mul_meta_dispatch.h>
#include <ATen/ops/neg_meta_dispatch.h>
#include <ATen/ops/nll_loss_backward_meta_dispatch.h>
#include <ATen/ops/nll_loss_forward_meta_dispatch.h>
#include <ATen/ops/pow_meta_dispatch.h>
#include <ATen/ops/result_type.h>
#include <ATen/ops/rsqrt_meta_dispatch.h>
#include <ATen/ops/sqrt_meta_dispatch.h>
#include <ATen/ops/sub_meta_dispatch.h>
#include <ATen/ops/sum_meta_dispatch.h>
#include <ATen/ops/tanh_meta_dispatch.h>
#include <ATen/ops/threshold_backward_meta_dispatch.h>
#include <ATen/ops/tril_meta_dispatch.h>
#include <ATen/ops/zero_meta_dispatch.h>
#include <torch/library.h>

namespace cumulus {
namespace {

using T = at::Tensor;
using S = at::Scalar;
using Stack = torch::jit::Stack;

template <typename Sig, Sig* fn>
c10::KernelFunction unboxed() {
  return c10::KernelFunction::makeFromUnboxedFunction(c10::CompileTimeFunctionPointer<Sig, fn>());
}

// `at::meta::<op>` is overloaded, so each entry names the schema's C++ signature.
#define META(name, Sig, fn) {name, &unboxed<Sig, static_cast<std::add_pointer_t<Sig>>(&fn)>}

using Binary = T(const T&, const T&);
using BinaryAlpha = T(const T&, const T&, const S&);
using InplaceBinary = T&(T&, const T&);
using InplaceBinaryAlpha = T&(T&, const T&, const S&);
using Pointwise = T(const T&, const T&, const T&, const S&);
using InplacePointwise = T&(T&, const T&, const T&, const S&);
using Unary = T(const T&);
using InplaceUnary = T&(T&);
using Reduce = T(const T&, at::OptionalIntArrayRef, bool, std::optional<at::ScalarType>);
using Softmax = T(const T&, int64_t, bool);
using SoftmaxBackward = T(const T&, const T&, int64_t, at::ScalarType);
using BinaryOut = T&(const T&, const T&, T&);
using BinaryAlphaOut = T&(const T&, const T&, const S&, T&);
using ArangeOut = T&(const S&, const S&, const S&, T&);
using PowScalar = T(const T&, const S&);
using Fill = T&(T&, const S&);
using Gelu = T(const T&, c10::string_view);
using GeluBackward = T(const T&, const T&, c10::string_view);
using Addmm = T(const T&, const T&, const T&, const S&, const S&);
using AllDim = T(const T&, int64_t, bool);
using Tril = T(const T&, int64_t);
using Cat = T(const at::ITensorListRef&, int64_t);
using NllForward = std::tuple<T, T>(const T&, const T&, const std::optional<T>&, int64_t,
                                    c10::SymInt);
using NllBackward = T(const T&, const T&, const T&, const std::optional<T>&, int64_t,
                      c10::SymInt, const T&);

const std::unordered_map<std::string, c10::KernelFunction (*)()>& meta_kernels() {
  static const auto* table = new std::unordered_map<std::string, c10::KernelFunction (*)()>{
      META("aten::add.Tensor", BinaryAlpha, at::meta::add),
      META("aten::add_.Tensor", InplaceBinaryAlpha, at::meta::add_),
      META("aten::sub.Tensor", BinaryAlpha, at::meta::sub),
      META("aten::sub_.Tensor", InplaceBinaryAlpha, at::meta::sub_),
      META("aten::add.out", BinaryAlphaOut, at::meta::add_outf),
      META("aten::mul.Tensor", Binary, at::meta::mul),
      META("aten::mul.out", BinaryOut, at::meta::mul_outf),
      META("aten::mul_.Tensor", InplaceBinary, at::meta::mul_),
      META("aten::div.Tensor", Binary, at::meta::div),
      META("aten::div_.Tensor", InplaceBinary, at::meta::div_),
      META("aten::addcmul", Pointwise, at::meta::addcmul),
      META("aten::addcmul_", InplacePointwise, at::meta::addcmul_),
      META("aten::addcdiv", Pointwise, at::meta::addcdiv),
      META("aten::addcdiv_", InplacePointwise, at::meta::addcdiv_),
      META("aten::lerp.Scalar", BinaryAlpha, at::meta::lerp),
      META("aten::lerp_.Scalar", InplaceBinaryAlpha, at::meta::lerp_),
      META("aten::pow.Tensor_Scalar", PowScalar, at::meta::pow),
      META("aten::threshold_backward", BinaryAlpha, at::meta::threshold_backward),
      META("aten::sqrt", Unary, at::meta::sqrt),
      META("aten::sqrt_", InplaceUnary, at::meta::sqrt_),
      META("aten::rsqrt", Unary, at::meta::rsqrt),
      META("aten::neg", Unary, at::meta::neg),
      META("aten::exp", Unary, at::meta::exp),
      META("aten::tanh", Unary, at::meta::tanh),
      META("aten::isneginf", Unary, at::meta::isneginf),
      META("aten::zero_", InplaceUnary, at::meta::zero_),
      META("aten::fill_.Scalar", Fill, at::meta::fill_),
      META("aten::gelu", Gelu, at::meta::gelu),
      META("aten::gelu_backward", GeluBackward, at::meta::gelu_backward),
      META("aten::mm", Binary, at::meta::mm),
      META("aten::bmm", Binary, at::meta::bmm),
      META("aten::addmm", Addmm, at::meta::addmm),
      META("aten::sum.dim_IntList", Reduce, at::meta::sum),
      META("aten::mean.dim", Reduce, at::meta::mean),
      META("aten::all.dim", AllDim, at::meta::all),
      META("aten::tril", Tril, at::meta::tril),
      META("aten::cat", Cat, at::meta::cat),
      META("aten::arange.start_out", ArangeOut, at::meta::arange_outf),
      META("aten::_softmax", Softmax, at::meta::_softmax),
      META("aten::_log_softmax", Softmax, at::meta::_log_softmax),
      META("aten::_softmax_backward_data", SoftmaxBackward, at::meta::_softmax_backward_data),
      META("aten::_log_softmax_backward_data", SoftmaxBackward,
           at::meta::_log_softmax_backward_data),
      META("aten::nll_loss_forward", NllForward, at::meta::nll_loss_forward_symint),
      META("aten::nll_loss_backward", NllBackward, at::meta::nll_loss_backward_symint),
  };
  return *table;
}

#undef META

// ---- rules for ops whose only meta kernel is Python --------------------------------
// Each pops its schema's arguments (meta tensors by now) and pushes meta outputs.
// Outputs are contiguous; the executor's kernel may choose other strides, which the
// replay loop reconciles.

T meta_like(const T& t, std::optional<at::ScalarType> dtype = std::nullopt) {
  return at::detail::empty_meta(t.sizes(), dtype.value_or(t.scalar_type()));
}

at::ScalarType stats_type(at::ScalarType input) {
  return at::isReducedFloatingType(input) ? at::kFloat : input;
}

// native_layer_norm(input, normalized_shape, weight?, bias?, eps) -> (out, mean, rstd)
void layer_norm(Stack* stack) {
  const auto args = torch::jit::pop(*stack, 5);
  const T& input = args[0].toTensor();
  const auto normalized = args[1].toSymIntVector();
  std::vector<int64_t> stat_shape(input.sizes().begin(), input.sizes().end());
  const size_t axis = stat_shape.size() - normalized.size();
  std::fill(stat_shape.begin() + axis, stat_shape.end(), 1);
  const auto stats = stats_type(input.scalar_type());
  torch::jit::push(*stack, meta_like(input), at::detail::empty_meta(stat_shape, stats),
                   at::detail::empty_meta(stat_shape, stats));
}

// native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight?,
// bias?, output_mask) -> (grad_input?, grad_weight?, grad_bias?)
void layer_norm_backward(Stack* stack) {
  const auto args = torch::jit::pop(*stack, 8);
  const auto mask = args[7].toBoolList();
  auto like_if = [](bool wanted, const c10::IValue& v) {
    return wanted && v.isTensor() ? meta_like(v.toTensor()) : T();
  };
  torch::jit::push(*stack, like_if(mask[0], args[1]), like_if(mask[1], args[5]),
                   like_if(mask[2], args[6]));
}

// native_dropout(input, p, train?) -> (out, mask)
void dropout(Stack* stack) {
  const auto args = torch::jit::pop(*stack, 3);
  const T& input = args[0].toTensor();
  torch::jit::push(*stack, meta_like(input), meta_like(input, at::kBool));
}

// native_dropout_backward(grad_output, mask, scale) -> grad_input
void dropout_backward(Stack* stack) {
  const auto args = torch::jit::pop(*stack, 3);
  torch::jit::push(*stack, meta_like(args[0].toTensor()));
}

// where.self(condition, self, other) -> out: broadcast shape, promoted dtype.
void where(Stack* stack) {
  const auto args = torch::jit::pop(*stack, 3);
  const T& cond = args[0].toTensor();
  const T& self = args[1].toTensor();
  const T& other = args[2].toTensor();
  const auto shape = at::infer_size(at::infer_size(cond.sizes(), self.sizes()), other.sizes());
  torch::jit::push(*stack, at::detail::empty_meta(shape, at::result_type(self, other)));
}

// where.self_out(condition, self, other, out) -> out, resized to the broadcast shape.
void where_out(Stack* stack) {
  const T out = torch::jit::pop(*stack).toTensor();
  where(stack);
  const T result = torch::jit::pop(*stack).toTensor();
  if (out.sizes() != result.sizes()) {
    out.unsafeGetTensorImpl()->set_sizes_contiguous(result.sizes());
    // A meta storage has no bytes to move; it only has to be big enough.
    const size_t nbytes = result.numel() * out.itemsize();
    auto* storage = out.storage().unsafeGetStorageImpl();
    if (storage->nbytes() < nbytes) storage->set_nbytes(nbytes);
  }
  torch::jit::push(*stack, out);
}

// index_select(self, dim, index) -> out: `dim` becomes the index's length.
void index_select(Stack* stack) {
  const auto args = torch::jit::pop(*stack, 3);
  const T& self = args[0].toTensor();
  std::vector<int64_t> shape(self.sizes().begin(), self.sizes().end());
  if (!shape.empty()) {
    shape[c10::maybe_wrap_dim(args[1].toInt(), self.dim())] = args[2].toTensor().numel();
  }
  torch::jit::push(*stack, at::detail::empty_meta(shape, self.scalar_type()));
}

// embedding_dense_backward(grad, indices, num_weights, padding_idx, scale) -> grad_weight
void embedding_dense_backward(Stack* stack) {
  const auto args = torch::jit::pop(*stack, 5);
  const T& grad = args[0].toTensor();
  const int64_t rows = args[2].toSymInt().expect_int();
  torch::jit::push(*stack, at::detail::empty_meta({rows, grad.size(-1)}, grad.scalar_type()));
}

// ---- histogramdd -----------------------------------------------------------------
// torch.histogramdd's three parts have no meta kernel, and the edges are a list, which
// the executor cannot shape for the client (run_dyn). Their shapes follow from the bins.

// The samples' dimension (self's last) must have one bin count or edge vector each.
void check_bins(const T& self, size_t nbins) {
  const int64_t dims = self.dim() == 0 ? 0 : self.size(-1);
  // The CPU kernel's words.
  TORCH_CHECK(self.dim() >= 1 && static_cast<int64_t>(nbins) == dims,
              "histogramdd: The size of bins must be equal to the innermost dimension of "
              "the input.");
}

// _histogramdd_bin_edges(self, bins, *, range?, weight?, density) -> one edge vector per
// dimension, bins[i] + 1 long.
void histogramdd_bin_edges(Stack* stack) {
  const auto args = torch::jit::pop(*stack, 5);
  const T& self = args[0].toTensor();
  const auto bins = args[1].toIntVector();
  check_bins(self, bins.size());
  c10::List<T> edges;
  for (int64_t n : bins) edges.push_back(at::detail::empty_meta({n + 1}, self.scalar_type()));
  torch::jit::push(*stack, std::move(edges));
}

// _histogramdd_from_bin_cts(self, bins, *, range?, weight?, density) -> hist shaped bins
void histogramdd_from_bin_cts(Stack* stack) {
  const auto args = torch::jit::pop(*stack, 5);
  const T& self = args[0].toTensor();
  const auto bins = args[1].toIntVector();
  check_bins(self, bins.size());
  torch::jit::push(*stack, at::detail::empty_meta(bins, self.scalar_type()));
}

// _histogramdd_from_bin_tensors(self, bins, *, weight?, density) -> hist, a bin fewer
// than each edge vector
void histogramdd_from_bin_tensors(Stack* stack) {
  const auto args = torch::jit::pop(*stack, 4);
  const T& self = args[0].toTensor();
  const auto edges = args[1].toTensorList();
  check_bins(self, edges.size());
  std::vector<int64_t> shape;
  for (const T& e : edges) shape.push_back(e.numel() - 1);
  torch::jit::push(*stack, at::detail::empty_meta(shape, self.scalar_type()));
}

// ---- foreach ops that return new lists ---------------------------------------------
// Adam's _foreach_sqrt, clip_grad_norm_'s _foreach_norm: one record for the list, each
// element shaped by its per-tensor op's C++ meta function. (Their own meta kernels are
// Python prims references, some 100 µs an element.)

T nth(const c10::IValue& list, size_t i) { return list.toTensorList().get(i); }
S nth_scalar(const c10::IValue& list, size_t i) { return list.toListRef()[i].toScalar(); }
T wrapped(const S& scalar) { return at::native::wrapped_scalar_tensor(scalar); }

// Pops the op's `nargs` arguments and pushes the list `each(args, i)` for each element
// of the first argument.
template <size_t nargs, typename Each>
void foreach_list(Stack* stack, Each each) {
  const auto args = torch::jit::pop(*stack, nargs);
  const size_t n = args[0].toTensorList().size();
  c10::List<T> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.push_back(each(args, i));
  torch::jit::push(*stack, std::move(out));
}

using Args = std::vector<c10::IValue>;

template <T (*fn)(const T&)>
void foreach_unary(Stack* stack) {
  foreach_list<1>(stack, [](const Args& a, size_t i) { return fn(nth(a[0], i)); });
}

// _foreach_<op>.List(self, other[, alpha]), .Scalar(self, scalar), .ScalarList(self,
// scalars): the per-tensor op with the element, the scalar or the scalar's element.
// (_foreach_lerp.Scalar(self, tensors1, weight) has the first's shape.)
template <T (*fn)(const T&, const T&, const S&)>
void foreach_list_alpha(Stack* stack) {
  foreach_list<3>(stack, [](const Args& a, size_t i) {
    return fn(nth(a[0], i), nth(a[1], i), a[2].toScalar());
  });
}
template <T (*fn)(const T&, const T&)>
void foreach_list_binary(Stack* stack) {
  foreach_list<2>(stack, [](const Args& a, size_t i) { return fn(nth(a[0], i), nth(a[1], i)); });
}
template <T (*fn)(const T&, const T&)>
void foreach_scalar(Stack* stack) {
  foreach_list<2>(stack,
                  [](const Args& a, size_t i) { return fn(nth(a[0], i), wrapped(a[1].toScalar())); });
}
template <T (*fn)(const T&, const T&)>
void foreach_scalar_list(Stack* stack) {
  foreach_list<2>(
      stack, [](const Args& a, size_t i) { return fn(nth(a[0], i), wrapped(nth_scalar(a[1], i))); });
}

T add(const T& a, const T& b) { return at::meta::add(a, b, 1); }
T sub(const T& a, const T& b) { return at::meta::sub(a, b, 1); }
T mul(const T& a, const T& b) { return at::meta::mul(a, b); }
T div(const T& a, const T& b) { return at::meta::div(a, b); }
T sqrt(const T& t) { return at::meta::sqrt(t); }
T rsqrt(const T& t) { return at::meta::rsqrt(t); }
T exp(const T& t) { return at::meta::exp(t); }
T neg(const T& t) { return at::meta::neg(t); }
T tanh(const T& t) { return at::meta::tanh(t); }
T add_alpha(const T& a, const T& b, const S& alpha) { return at::meta::add(a, b, alpha); }
T sub_alpha(const T& a, const T& b, const S& alpha) { return at::meta::sub(a, b, alpha); }
T lerp(const T& a, const T& b, const S& weight) { return at::meta::lerp(a, b, weight); }

// _foreach_addc{div,mul}.Scalar(self, tensor1, tensor2, value)
template <T (*fn)(const T&, const T&, const T&, const S&)>
void foreach_pointwise(Stack* stack) {
  foreach_list<4>(stack, [](const Args& a, size_t i) {
    return fn(nth(a[0], i), nth(a[1], i), nth(a[2], i), a[3].toScalar());
  });
}
T addcdiv(const T& s, const T& a, const T& b, const S& v) { return at::meta::addcdiv(s, a, b, v); }
T addcmul(const T& s, const T& a, const T& b, const S& v) { return at::meta::addcmul(s, a, b, v); }

// _foreach_pow.Scalar(self, exponent)
void foreach_pow(Stack* stack) {
  foreach_list<2>(stack,
                  [](const Args& a, size_t i) { return at::meta::pow(nth(a[0], i), a[1].toScalar()); });
}

// _foreach_norm.Scalar(self, ord, dtype?): each tensor's vector norm, a 0-dim tensor.
void foreach_norm(Stack* stack) {
  foreach_list<3>(stack, [](const Args& a, size_t i) {
    return at::meta::linalg_vector_norm(nth(a[0], i), a[1].toScalar(), std::nullopt, false,
                                        a[2].toOptional<at::ScalarType>());
  });
}

const std::unordered_map<std::string, void (*)(Stack*)>& rules() {
  static const auto* table = new std::unordered_map<std::string, void (*)(Stack*)>{
      {"aten::native_layer_norm", &layer_norm},
      {"aten::native_layer_norm_backward", &layer_norm_backward},
      {"aten::native_dropout", &dropout},
      {"aten::native_dropout_backward", &dropout_backward},
      {"aten::where.self", &where},
      {"aten::where.self_out", &where_out},
      {"aten::index_select", &index_select},
      {"aten::embedding_dense_backward", &embedding_dense_backward},
      {"aten::_histogramdd_bin_edges", &histogramdd_bin_edges},
      {"aten::_histogramdd_from_bin_cts", &histogramdd_from_bin_cts},
      {"aten::_histogramdd_from_bin_tensors", &histogramdd_from_bin_tensors},
      {"aten::_foreach_sqrt", &foreach_unary<sqrt>},
      {"aten::_foreach_rsqrt", &foreach_unary<rsqrt>},
      {"aten::_foreach_exp", &foreach_unary<exp>},
      {"aten::_foreach_neg", &foreach_unary<neg>},
      {"aten::_foreach_tanh", &foreach_unary<tanh>},
      {"aten::_foreach_add.List", &foreach_list_alpha<add_alpha>},
      {"aten::_foreach_sub.List", &foreach_list_alpha<sub_alpha>},
      {"aten::_foreach_mul.List", &foreach_list_binary<mul>},
      {"aten::_foreach_div.List", &foreach_list_binary<div>},
      {"aten::_foreach_add.Scalar", &foreach_scalar<add>},
      {"aten::_foreach_sub.Scalar", &foreach_scalar<sub>},
      {"aten::_foreach_mul.Scalar", &foreach_scalar<mul>},
      {"aten::_foreach_div.Scalar", &foreach_scalar<div>},
      {"aten::_foreach_add.ScalarList", &foreach_scalar_list<add>},
      {"aten::_foreach_sub.ScalarList", &foreach_scalar_list<sub>},
      {"aten::_foreach_mul.ScalarList", &foreach_scalar_list<mul>},
      {"aten::_foreach_div.ScalarList", &foreach_scalar_list<div>},
      {"aten::_foreach_addcdiv.Scalar", &foreach_pointwise<addcdiv>},
      {"aten::_foreach_addcmul.Scalar", &foreach_pointwise<addcmul>},
      {"aten::_foreach_lerp.Scalar", &foreach_list_alpha<lerp>},
      {"aten::_foreach_pow.Scalar", &foreach_pow},
      {"aten::_foreach_norm.Scalar", &foreach_norm},
  };
  return *table;
}

// "aten::add.Tensor" -> ("add", "Tensor"), as Library::impl wants it.
std::string schema_name(const std::string& full) { return full.substr(full.find("::") + 2); }

}  // namespace

ShapeFn find_shape_fn(const std::string& op_name) {
  ShapeFn fn;
  if (auto k = meta_kernels().find(op_name); k != meta_kernels().end()) fn.kernel = k->second();
  if (auto r = rules().find(op_name); r != rules().end()) fn.rule = r->second;
  return fn;
}

}  // namespace cumulus

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  for (const auto& [name, _] : cumulus::meta_kernels()) {
    m.impl(cumulus::schema_name(name).c_str(),
           torch::CppFunction::makeFromBoxedFunction<&cumulus::fallback>());
  }
  for (const auto& [name, _] : cumulus::rules()) {
    m.impl(cumulus::schema_name(name).c_str(),
           torch::CppFunction::makeFromBoxedFunction<&cumulus::fallback>());
  }
}
