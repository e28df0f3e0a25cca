// The `cumulus` device's kernels: metadata and views run here, everything else is
// recorded.
//
// Theory of operation
// -------------------
// Views (`view`, `as_strided`, `_reshape_alias`, and through them torch's composite
// `t`, `transpose`, `detach`, `expand`, `permute`...) only make a new TensorImpl over
// the same storage, exactly as on CPU, and append nothing: the executor learns about a
// view when an op uses it, from the (handle, offset, sizes, strides) of the reference.
//
// Every other op reaches one boxed fallback. It encodes the op's arguments, swaps each
// device tensor for a meta tensor of the same geometry, runs the op's meta kernel to
// learn the outputs' shapes, and maps the meta outputs back: an output that *is* an
// argument (in-place and out= ops) becomes that device tensor, one that shares an
// argument's storage becomes a device view of it, and any other gets a new storage
// handle. The record (record.h) goes to the batch only when the op produced a new
// storage or writes to an argument; pure views and queries such as
// `_fused_sdp_choice` stay on the client.
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_local_scalar_dense.h>
#include <ATen/ops/empty.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "record.h"
#include "shapes.h"

namespace cumulus {
namespace {

void record_alloc(const at::TensorBase& t) {
  append_alloc(handle_of(t.storage()), t.storage().nbytes());
}

// ---- factories ----------------------------------------------------------------------
// An empty tensor is a storage some later op fills in place, so the executor must
// create it: ALLOC. (An op's outputs need no ALLOC: the executor binds the op's
// results to their handles.)

at::Tensor empty_memory_format(c10::SymIntArrayRef size,
                               std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> /*layout*/,
                               std::optional<c10::Device> /*device*/,
                               std::optional<bool> /*pin_memory*/,
                               std::optional<c10::MemoryFormat> memory_format) {
  at::Tensor t = at::detail::empty_generic(C10_AS_INTARRAYREF_SLOW(size), kernel_allocator(),
                                     c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                     c10::dtype_or_default(dtype), memory_format);
  record_alloc(t);
  return t;
}

at::Tensor empty_strided(c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                         std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> /*layout*/,
                         std::optional<c10::Device> /*device*/,
                         std::optional<bool> /*pin_memory*/) {
  at::Tensor t = at::detail::empty_strided_generic(
      C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride), kernel_allocator(),
      c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), c10::dtype_or_default(dtype));
  record_alloc(t);
  return t;
}

// ---- views and metadata -------------------------------------------------------------

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size,
                      c10::SymIntArrayRef stride, std::optional<c10::SymInt> offset) {
  std::optional<int64_t> plain_offset;
  if (offset) plain_offset = offset->expect_int();
  return at::native::as_strided_tensorimpl(self, C10_AS_INTARRAYREF_SLOW(size),
                                           C10_AS_INTARRAYREF_SLOW(stride), plain_offset);
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size,
                         c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size),
                                    C10_AS_INTARRAYREF_SLOW(stride));
}

// `set_` points a tensor at a storage: metadata only, as a view is (the executor learns
// the geometry from the next reference). torch's storage copies wrap storages in
// tensors with it: torch.save reads each storage back through `storage.cpu()`.
void point_at(const at::Tensor& self, c10::Storage source, int64_t offset,
              c10::IntArrayRef sizes, std::optional<c10::IntArrayRef> strides) {
  TORCH_CHECK(source.device().type() == kType, "cumulus: set_ to a storage on ",
              source.device(), " (copy it to the device instead)");
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  if (strides) {
    impl->set_sizes_and_strides(sizes, *strides, offset);
  } else {
    impl->set_sizes_contiguous(sizes);
    impl->set_storage_offset(offset);
  }
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source) {
  const int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  point_at(self, std::move(source), 0, {numel}, std::nullopt);
  return self;
}

at::Tensor& set_storage_offset(at::Tensor& self, c10::Storage source, c10::SymInt offset,
                               c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  std::optional<c10::IntArrayRef> strides;
  if (!stride.empty()) strides = C10_AS_INTARRAYREF_SLOW(stride);
  point_at(self, std::move(source), offset.expect_int(), C10_AS_INTARRAYREF_SLOW(size), strides);
  return self;
}

// Growing a storage keeps its handle (the executor resizes it in place), so tensors
// that share the storage keep naming the same bytes.
void grow_storage(const at::Tensor& self, size_t nbytes) {
  c10::StorageImpl* storage = self.storage().unsafeGetStorageImpl();
  if (nbytes <= storage->nbytes()) return;
  append_resize(handle_of(self.storage()), nbytes);
  set_storage_bytes(storage, nbytes);
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  const auto sizes = C10_AS_INTARRAYREF_SLOW(size);
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  if (self.sizes() != sizes) {
    impl->set_sizes_contiguous(sizes);
    grow_storage(self, at::detail::computeStorageNbytesContiguous(
                           sizes, self.dtype().itemsize(), self.storage_offset()));
  }
  if (memory_format) impl->empty_tensor_restride(*memory_format);
  return self;
}

// `Module.to("cumulus")` swaps each parameter's data in place (`param.data = moved`)
// when torch says the two tensors' impls are compatible, and otherwise makes a new
// Parameter per module, which silently unties tied weights (a GPT's embedding and
// output layer). c10 counts only its own backends as dense, so PrivateUse1 says it
// here: a cumulus tensor is a plain strided tensor, as a CPU one is.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto plain = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && (t.is_cpu() || t.is_privateuseone());
  };
  return plain(self) && plain(from);
}

// ---- copies -------------------------------------------------------------------------

void record_device_copy(const at::Tensor& dst, const at::Tensor& src, bool non_blocking) {
  static const uint32_t copy_op = intern_name("aten::copy_");
  Writer w;
  w.begin_record(Kind::Op);
  w.put<uint32_t>(copy_op);
  w.put<uint16_t>(3);
  put_tensor_ref(w, dst);
  put_tensor_ref(w, src);
  put_value(w, non_blocking);
  w.put<uint16_t>(1);
  put_tensor_ref(w, dst);
  w.end_record();
  append_record(w);
}

void record_upload_piece(const at::Tensor& dst, const at::Tensor& src) {
  Writer w;
  w.begin_record(Kind::Upload);
  put_tensor_ref(w, dst);
  put_tensor_ref(w, src);  // a host tensor: its bytes travel in the record
  w.end_record();
  append_record(w);
  maybe_flush();  // a model's many uploads must not pile up into one oversized frame
}

// A large upload goes piece by piece into a contiguous device tensor (dst itself when it
// is one), the batch flushed as it fills, then copied into dst on the device.
void record_upload(const at::Tensor& dst, const at::Tensor& src) {
  if (src.nbytes() <= static_cast<size_t>(kPieceBytes) || !src.sizes().equals(dst.sizes())) {
    record_upload_piece(dst, src);
    return;
  }
  const at::Tensor whole = dst.is_contiguous() ? dst : at::empty(dst.sizes(), dst.options());
  for_each_piece(src.contiguous().view(-1), whole.view(-1),
                 [](const at::Tensor& from, const at::Tensor& to) {
                   record_upload_piece(to, from);
                 });
  if (!whole.is_same(dst)) record_device_copy(dst, whole, false);
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  if (self.is_privateuseone() && dst.is_privateuseone()) {
    record_device_copy(dst, self, non_blocking);
  } else if (dst.is_privateuseone()) {
    record_upload(dst, self);
  } else {
    read_back(self, dst);
  }
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  resize_(dst, self.sym_sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  const at::Tensor host = at::empty({}, self.options().device(c10::kCPU));
  read_back(self, host);
  return at::_local_scalar_dense(host);
}

// ---- the fallback -------------------------------------------------------------------

// The device storages and tensors a meta call stands in for. A handful per op, so
// linear search beats hashing.
struct MetaArgs {
  c10::SmallVector<std::pair<c10::Storage, c10::Storage>, 8> storages;  // (device, meta)
  c10::SmallVector<std::pair<c10::TensorImpl*, at::Tensor>, 8> tensors;  // (meta, device)
  bool fresh = false;  // an output got a new storage handle

  // The meta storage for a device storage; shared, so that aliasing survives on meta.
  c10::Storage meta_storage(const c10::Storage& device) {
    for (auto& [d, m] : storages) {
      if (d.unsafeGetStorageImpl() == device.unsafeGetStorageImpl()) return m;
    }
    c10::Storage meta(c10::make_intrusive<c10::StorageImpl>(
        c10::StorageImpl::use_byte_size_t(), device.sym_nbytes(),
        c10::DataPtr(nullptr, c10::Device(c10::kMeta)), c10::GetAllocator(c10::kMeta),
        /*resizable=*/true));
    storages.emplace_back(device, meta);
    return meta;
  }

  const c10::Storage* device_storage(const c10::Storage& meta) const {
    for (auto& [d, m] : storages) {
      if (m.unsafeGetStorageImpl() == meta.unsafeGetStorageImpl()) return &d;
    }
    return nullptr;
  }
};

// A TensorImpl over `storage` with `like`'s geometry and dtype, built directly: going
// through the dispatcher (empty_strided, as_strided) would cost a dispatch per tensor.
at::Tensor tensor_over(c10::Storage storage, c10::DispatchKeySet keys, const at::Tensor& like) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), keys, like.dtype());
  impl->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  impl->_set_conj(like.is_conj());
  impl->_set_neg(like.is_neg());
  return at::Tensor(std::move(impl));
}

at::Tensor to_meta(const at::Tensor& t, MetaArgs& m) {
  if (!t.defined() || !t.is_privateuseone()) return t;
  at::Tensor meta =
      tensor_over(m.meta_storage(t.storage()), c10::DispatchKeySet(c10::DispatchKey::Meta), t);
  m.tensors.emplace_back(meta.unsafeGetTensorImpl(), t);
  return meta;
}

// The op returned an argument; an out= op may have resized it on meta.
at::Tensor mirror_argument(const at::Tensor& meta, const at::Tensor& device) {
  if (meta.sizes() != device.sizes() || meta.strides() != device.strides()) {
    device.unsafeGetTensorImpl()->set_sizes_and_strides(meta.sizes(), meta.strides(),
                                                        meta.storage_offset());
    // The executor grows its storage itself when it runs the op.
    set_storage_bytes(device.storage().unsafeGetStorageImpl(), meta.storage().nbytes());
  }
  return device;
}

at::Tensor from_meta(const at::Tensor& meta, MetaArgs& m) {
  if (!meta.defined() || !meta.is_meta()) return meta;
  for (auto& [impl, device] : m.tensors) {
    if (impl == meta.unsafeGetTensorImpl()) return mirror_argument(meta, device);
  }
  if (const c10::Storage* device = m.device_storage(meta.storage())) {
    return tensor_over(*device, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), meta);
  }
  const size_t nbytes = meta.storage().nbytes();
  c10::Storage fresh(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, kernel_allocator()->allocate(nbytes),
      kernel_allocator(), /*resizable=*/true));
  // Later outputs over the same new storage become views of this one.
  m.storages.emplace_back(fresh, meta.storage());
  m.fresh = true;
  return tensor_over(std::move(fresh), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                     meta);
}

template <typename F>
c10::IValue map_tensors(const c10::IValue& v, F&& fn) {
  if (v.isTensor()) return fn(v.toTensor());
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(fn(t));
    return out;
  }
  if (v.isOptionalTensorList()) {
    c10::List<std::optional<at::Tensor>> out;
    for (const std::optional<at::Tensor>& t : v.toOptionalTensorList()) {
      out.push_back(t ? std::optional<at::Tensor>(fn(*t)) : std::nullopt);
    }
    return out;
  }
  return v;
}

// What the fallback needs about an op, resolved once: its name table index and how to
// get its output shapes without Python.
struct OpEntry {
  uint32_t id;
  ShapeFn shape;
};

// An op that only writes its arguments: it returns nothing.
bool in_place_only(const c10::FunctionSchema& schema) {
  return schema.returns().empty() && schema.is_mutable();
}

const OpEntry& entry(const c10::OperatorHandle& op) {
  static std::mutex mutex;
  static auto* entries = new std::unordered_map<c10::OperatorHandle, OpEntry>();
  std::lock_guard<std::mutex> lock(mutex);
  auto found = entries->find(op);
  if (found != entries->end()) return found->second;
  const uint32_t id = intern(op);
  ShapeFn shape = find_shape_fn(op_names()[id]);
  if (op_names()[id].rfind("aten::_foreach_", 0) == 0 && !shape.known()) {
    shape.nothing = in_place_only(op.schema());
  }
  return entries->emplace(op, OpEntry{id, shape}).first->second;
}

void run_on_meta(const c10::OperatorHandle& op, const ShapeFn& shape, torch::jit::Stack* stack) {
  const c10::DispatchKeySet meta(c10::DispatchKey::Meta);
  if (shape.rule != nullptr) {
    shape.rule(stack);
  } else if (shape.kernel) {
    shape.kernel->callBoxed(op, meta, stack);
  } else if (shape.nothing) {
    torch::jit::drop(*stack, op.schema().arguments().size());
  } else {
    // Straight to the meta kernel: the keys above it (autograd, autocast) already ran.
    op.redispatchBoxed(meta, stack);
  }
}

}  // namespace

// Whether a meta kernel failed because only the real op can know its outputs' shapes
// (no meta kernel at all, or one that refuses data-dependent outputs), rather than
// because the arguments are wrong.
bool unknown_on_meta(const char* what) {
  for (const char* sign : {"Meta tensors", "'Meta' backend", "register_meta", "a meta tensor",
                           "DataDependent", "data-dependent", "data dependent"}) {
    if (std::strstr(what, sign) != nullptr) return true;
  }
  return false;
}

// A fresh device storage whose handle the executor will bind; sized once it answers.
c10::Storage handle_storage() {
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), 0, kernel_allocator()->allocate(0),
      kernel_allocator(), /*resizable=*/true));
}

// One of a DYN record's results (record.h's Result): a tensor's dtype and sizes, or a
// scalar.
struct Result {
  Tag tag = Tag::None;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  c10::IValue scalar;
};

class Results {
 public:
  explicit Results(std::string bytes) : bytes_(std::move(bytes)) {}

  Result next() {
    Result r;
    r.tag = static_cast<Tag>(take<uint8_t>());
    switch (r.tag) {
      case Tag::None:
        break;
      case Tag::Tensor:
        r.dtype = static_cast<c10::ScalarType>(take<uint8_t>());
        r.sizes.resize(take<uint8_t>());
        r.strides.resize(r.sizes.size());
        for (auto& size : r.sizes) size = take<int64_t>();
        for (auto& stride : r.strides) stride = take<int64_t>();
        r.offset = take<int64_t>();
        break;
      case Tag::Int:
        r.scalar = take<int64_t>();
        break;
      case Tag::Double:
        r.scalar = take<double>();
        break;
      case Tag::Bool:
        r.scalar = static_cast<bool>(take<uint8_t>());
        break;
      default:
        TORCH_CHECK(false, "cumulus: the executor sent an unknown result");
    }
    return r;
  }

 private:
  template <typename T>
  T take() {
    T value;
    TORCH_CHECK(at_ + sizeof(T) <= bytes_.size(), "cumulus: the executor's results are truncated");
    std::memcpy(&value, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return value;
  }

  std::string bytes_;
  size_t at_ = 0;
};

// A contiguous tensor of `sizes` over a storage the executor just filled.
at::Tensor over_result(c10::Storage storage, const Result& r) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::scalarTypeToTypeMeta(r.dtype));
  impl->set_sizes_contiguous(r.sizes);
  set_storage_bytes(impl->storage().unsafeGetStorageImpl(), impl->numel() * impl->itemsize());
  return at::Tensor(std::move(impl));
}

// The argument an out= return aliases, resized as the executor resized it.
at::Tensor resized_argument(const c10::FunctionSchema& schema, size_t ret,
                            c10::ArrayRef<c10::IValue> args, const Result& r) {
  const auto* alias = schema.returns()[ret].alias_info();
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto* arg_alias = schema.arguments()[i].alias_info();
    if (arg_alias == nullptr || arg_alias->beforeSets() != alias->beforeSets()) continue;
    const at::Tensor t = args[i].toTensor();
    t.unsafeGetTensorImpl()->set_sizes_and_strides(r.sizes, r.strides, r.offset);
    const size_t needed = at::detail::computeStorageNbytes(r.sizes, r.strides, t.itemsize()) +
                          r.offset * t.itemsize();
    auto* storage = t.storage().unsafeGetStorageImpl();
    if (storage->nbytes() < needed) set_storage_bytes(storage, needed);  // the executor grew it
    return t;
  }
  TORCH_CHECK(false, "cumulus: ", schema.name(), "'s return ", ret, " aliases no argument");
}

// Runs `op` on the executor at once (DYN) and takes its outputs from the answer: a new
// storage for each fresh tensor, the argument itself for an out= return.
void run_dyn(const c10::OperatorHandle& op, const OpEntry& e, c10::ArrayRef<c10::IValue> args,
             torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& returns = schema.returns();
  Writer w;
  w.begin_record(Kind::Dyn);
  w.put<uint32_t>(e.id);
  w.put<uint16_t>(static_cast<uint16_t>(args.size()));
  for (const auto& arg : args) put_value(w, arg);
  w.put<uint16_t>(static_cast<uint16_t>(returns.size()));
  std::vector<c10::Storage> storages(returns.size());
  for (size_t i = 0; i < returns.size(); ++i) {
    const auto kind = returns[i].type()->kind();
    TORCH_CHECK(kind != c10::TypeKind::ListType,
                "cumulus: ", schema.name(), " returns a list of tensors only the executor "
                "can shape, which the native device does not support yet");
    if (kind == c10::TypeKind::TensorType && returns[i].alias_info() == nullptr) {
      storages[i] = handle_storage();
    }
    w.put<uint64_t>(storages[i] ? handle_of(storages[i]) : 0);
  }
  w.end_record();
  append_record(w);
  Results results(sync());
  stack->erase(stack->end() - static_cast<std::ptrdiff_t>(args.size()), stack->end());
  for (size_t i = 0; i < returns.size(); ++i) {
    const Result r = results.next();
    if (r.tag != Tag::Tensor) {
      stack->push_back(r.scalar);
    } else if (storages[i]) {
      stack->push_back(over_result(std::move(storages[i]), r));
    } else {
      stack->push_back(resized_argument(schema, i, args, r));
    }
  }
}

std::vector<c10::IValue> run_on_executor(const c10::OperatorHandle& op,
                                         std::vector<c10::IValue> args) {
  torch::jit::Stack stack(args.begin(), args.end());
  run_dyn(op, entry(op), args, &stack);
  return stack;
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const OpEntry& e = entry(op);
  const size_t nargs = schema.arguments().size();
  const size_t base = stack->size() - nargs;
  // Kept for an op whose meta kernel cannot shape its outputs (run_dyn).
  const c10::SmallVector<c10::IValue, 8> args(stack->begin() + base, stack->end());
  // One writer per thread (autograd's device thread records backward ops), reused
  // so that a record costs no allocation once the buffer has grown.
  thread_local Writer w;
  w.clear();
  w.begin_record(Kind::Op);
  w.put<uint32_t>(e.id);
  w.put<uint16_t>(static_cast<uint16_t>(nargs));
  MetaArgs m;
  for (size_t i = stack->size() - nargs; i < stack->size(); ++i) {
    put_value(w, (*stack)[i]);
    (*stack)[i] = map_tensors((*stack)[i], [&](const at::Tensor& t) { return to_meta(t, m); });
  }
  try {
    run_on_meta(op, e.shape, stack);
  } catch (const std::exception& failed) {
    if (!unknown_on_meta(failed.what())) throw;
    stack->resize(base);
    stack->insert(stack->end(), args.begin(), args.end());
    run_dyn(op, e, args, stack);
    return;
  }
  const size_t nouts = schema.returns().size();
  w.put<uint16_t>(static_cast<uint16_t>(nouts));
  for (size_t i = stack->size() - nouts; i < stack->size(); ++i) {
    (*stack)[i] = map_tensors((*stack)[i], [&](const at::Tensor& t) { return from_meta(t, m); });
    put_value(w, (*stack)[i]);
  }
  w.end_record();
  if (m.fresh || schema.is_mutable()) {
    append_record(w);
    maybe_flush();
  }
}

// ---- convolution --------------------------------------------------------------------
//
// On a backend other than CPU and CUDA, torch routes convolutions to the *_overrideable
// ops, whose default kernels throw. Here they record the ops an executor runs (on
// whichever device it has): aten::convolution and aten::convolution_backward.

c10::OperatorHandle aten_op(const char* name, const char* overload = "") {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
}

at::Tensor convolution_overrideable(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                    at::IntArrayRef padding, at::IntArrayRef dilation,
                                    bool transposed, at::IntArrayRef output_padding,
                                    int64_t groups) {
  static const c10::OperatorHandle op = aten_op("aten::convolution");
  torch::jit::Stack stack{input, weight, bias, stride, padding, dilation,
                          transposed, output_padding, groups};
  fallback(op, &stack);
  return stack.back().toTensor();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
    at::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> output_mask) {
  static const c10::OperatorHandle op = aten_op("aten::convolution_backward");
  // The bias has one value per output channel.
  const int64_t channels = transposed ? weight.size(1) * groups : weight.size(0);
  const std::vector<int64_t> bias_sizes{channels};
  c10::List<bool> mask;
  for (bool wanted : output_mask) mask.push_back(wanted);
  torch::jit::Stack stack{grad_output, input, weight, bias_sizes, stride, padding, dilation,
                          transposed, output_padding, groups, mask};
  fallback(op, &stack);
  return {stack[0].toTensor(), stack[1].toTensor(), stack[2].toTensor()};
}

}  // namespace cumulus

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("convolution_overrideable", cumulus::convolution_overrideable);
  m.impl("convolution_backward_overrideable", cumulus::convolution_backward_overrideable);
  m.impl("empty.memory_format", cumulus::empty_memory_format);
  m.impl("empty_strided", cumulus::empty_strided);
  m.impl("as_strided", cumulus::as_strided);
  m.impl("view", cumulus::view);
  m.impl("_reshape_alias", cumulus::reshape_alias);
  m.impl("resize_", cumulus::resize_);
  m.impl("set_.source_Storage", cumulus::set_storage);
  m.impl("set_.source_Storage_storage_offset", cumulus::set_storage_offset);
  m.impl("_has_compatible_shallow_copy_type", cumulus::has_compatible_shallow_copy_type);
  m.impl("_copy_from", cumulus::copy_from);
  m.impl("_copy_from_and_resize", cumulus::copy_from_and_resize);
  m.impl("_local_scalar_dense", cumulus::local_scalar_dense);
}

// torch's conjugate and negative fallbacks resolve a lazy conj()/neg view by cloning it,
// and a clone on this device copies through _copy_from, which they would catch again,
// forever. Through to copy_from instead, whose records carry the bits (TENSOR_BITS).
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&cumulus::fallback>());
}

namespace cumulus {
namespace {

// Foreach ops (an optimizer's step, gradient clipping) have composite kernels that loop
// over their lists: on this device they would record one op per tensor, 364 records for
// a small transformer's Adam step. The in-place ones, registered for the device, go to
// the fallback whole: one record each, with nothing to shape, and a GPU executor runs
// its multi-tensor kernel. They are taken from the dispatcher at load. Those that return
// new lists are registered by shapes.cpp, which shapes them element by element in C++;
// the rest stay composite (their meta kernels are Python prims references, some 100 µs
// an element, where each element's own op is shaped in C++).
const bool foreach_registered = [] {
  auto& dispatcher = c10::Dispatcher::singleton();
  static auto* handles = new std::vector<c10::RegistrationHandleRAII>();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::_foreach_", 0) != 0) continue;
    const auto op = dispatcher.findSchema(name);
    if (!op || !in_place_only(op->schema())) continue;
    handles->push_back(dispatcher.registerImpl(
        name, c10::DispatchKey::PrivateUse1,
        c10::KernelFunction::makeFromBoxedFunction<&fallback>(), std::nullopt, nullptr,
        "cumulus: foreach ops as one record"));
  }
  return true;
}();

}  // namespace
}  // namespace cumulus
