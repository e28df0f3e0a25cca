// Encoding values into wire records, the batch they go to, and the op name table.
// The format is documented in record.h.
#include "record.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <mutex>
#include <unordered_map>

namespace cumulus {

uint64_t handle_of(const c10::Storage& storage) {
  return reinterpret_cast<uint64_t>(storage.unsafeGetStorageImpl()->data_ptr().get());
}

namespace {

void put_shape(Writer& w, const at::Tensor& t) {
  w.put<uint8_t>(static_cast<uint8_t>(t.scalar_type()));
  w.put<uint8_t>(static_cast<uint8_t>(t.dim()));
  for (int64_t size : t.sizes()) w.put<int64_t>(size);
}

// A host tensor argument (a CPU scalar tensor such as Adam's step, or an upload's
// source) travels by value: the executor has no other way to see its bytes.
void put_host_tensor(Writer& w, const at::Tensor& t) {
  const at::Tensor dense = t.resolve_conj().resolve_neg().contiguous();
  const bool number = t.unsafeGetTensorImpl()->is_wrapped_number();
  w.put<uint8_t>(static_cast<uint8_t>(number ? Tag::Number : Tag::HostTensor));
  put_shape(w, dense);
  w.put<uint64_t>(dense.nbytes());
  w.bytes(dense.const_data_ptr(), dense.nbytes());
}

void put_ints(Writer& w, c10::IntArrayRef ints) {
  w.put<uint8_t>(static_cast<uint8_t>(Tag::Ints));
  w.put<uint32_t>(static_cast<uint32_t>(ints.size()));
  w.bytes(ints.data(), ints.size() * sizeof(int64_t));
}

void put_list(Writer& w, c10::ArrayRef<c10::IValue> items) {
  w.put<uint8_t>(static_cast<uint8_t>(Tag::List));
  w.put<uint32_t>(static_cast<uint32_t>(items.size()));
  for (const auto& item : items) put_value(w, item);
}

void put_scalar(Writer& w, const c10::IValue& v) {
  if (put_plain_scalar(w, v)) return;
  if (v.isSymInt()) {
    w.put<uint8_t>(static_cast<uint8_t>(Tag::Int));
    w.put<int64_t>(v.toSymInt().expect_int());
  } else if (v.isComplexDouble()) {
    const auto z = v.toComplexDouble();
    w.put<uint8_t>(static_cast<uint8_t>(Tag::Complex));
    w.put<double>(z.real());
    w.put<double>(z.imag());
  } else {
    TORCH_CHECK(false, "cumulus: cannot put a ", v.tagKind(), " argument on the wire");
  }
}

}  // namespace

void put_tensor_ref(Writer& w, const at::Tensor& t) {
  if (!t.defined()) {
    w.put<uint8_t>(static_cast<uint8_t>(Tag::None));
    return;
  }
  if (!t.is_privateuseone()) {
    put_host_tensor(w, t);
    return;
  }
  const uint8_t bits = (t.is_conj() ? kConjBit : 0) | (t.is_neg() ? kNegBit : 0);
  if (bits) {
    w.put<uint8_t>(static_cast<uint8_t>(Tag::TensorBits));
    w.put<uint8_t>(bits);
  } else {
    w.put<uint8_t>(static_cast<uint8_t>(Tag::Tensor));
  }
  w.put<uint64_t>(handle_of(t.storage()));
  w.put<int64_t>(t.storage_offset());
  put_shape(w, t);
  for (int64_t stride : t.strides()) w.put<int64_t>(stride);
}

void put_value(Writer& w, const c10::IValue& v) {
  if (v.isNone()) {
    w.put<uint8_t>(static_cast<uint8_t>(Tag::None));
  } else if (v.isTensor()) {
    put_tensor_ref(w, v.toTensor());
  } else if (v.isIntList()) {
    put_ints(w, v.toIntList().vec());
  } else if (v.isSymIntList()) {
    put_ints(w, C10_AS_INTARRAYREF_SLOW(v.toSymIntList().vec()));
  } else if (v.isList()) {
    put_list(w, v.toListRef());
  } else if (v.isTuple()) {
    put_list(w, v.toTupleRef().elements());
  } else if (v.isString()) {
    const auto& s = v.toStringRef();
    w.put<uint8_t>(static_cast<uint8_t>(Tag::String));
    w.put<uint32_t>(static_cast<uint32_t>(s.size()));
    w.bytes(s.data(), s.size());
  } else if (v.isDevice()) {
    w.put<uint8_t>(static_cast<uint8_t>(Tag::Device));
    w.put<int8_t>(static_cast<int8_t>(v.toDevice().type()));
    w.put<int8_t>(v.toDevice().index());
  } else if (v.isGenerator()) {
    w.put<uint8_t>(static_cast<uint8_t>(Tag::Generator));
  } else {
    put_scalar(w, v);
  }
}

// ---- the batch ----------------------------------------------------------------------

namespace {

struct Batch {
  std::mutex mutex;
  std::string data;
  uint64_t records = 0;  // in `data`
  uint64_t ops = 0;      // op records appended since the process started
};

// Leaked on purpose: storages die (and append FREE records) during interpreter
// shutdown, after static destructors would have run.
Batch& batch() {
  static Batch* b = new Batch();
  return *b;
}

}  // namespace

void append_record(const Writer& w) {
  const auto kind = static_cast<Kind>(w.data()[0]);
  Batch& b = batch();
  std::lock_guard<std::mutex> lock(b.mutex);
  b.data.append(w.data());
  b.records += 1;
  b.ops += kind == Kind::Op || kind == Kind::Dyn || kind == Kind::Run;
}

uint64_t ops_recorded() {
  Batch& b = batch();
  std::lock_guard<std::mutex> lock(b.mutex);
  return b.ops;
}

namespace {
// A record whose body is a few u64 fields (ALLOC, FREE, RESIZE, SEED).
void append_u64s(Kind kind, std::initializer_list<uint64_t> fields) {
  Writer w;
  w.begin_record(kind);
  for (const uint64_t field : fields) w.put<uint64_t>(field);
  w.end_record();
  append_record(w);
}
}  // namespace

void append_alloc(uint64_t handle, uint64_t nbytes) {
  append_u64s(Kind::Alloc, {handle, nbytes});
}
void append_free(uint64_t handle) { append_u64s(Kind::Free, {handle}); }
void append_resize(uint64_t handle, uint64_t nbytes) {
  append_u64s(Kind::Resize, {handle, nbytes});
}
void append_seed(uint64_t seed) { append_u64s(Kind::Seed, {seed}); }

std::string rng_state() {
  Writer w;
  w.begin_record(Kind::RngGet);
  w.end_record();
  append_record(w);
  return sync();
}

void append_rng_state(const std::string& state) {
  Writer w;
  w.begin_record(Kind::RngSet);
  w.put<uint32_t>(static_cast<uint32_t>(state.size()));
  w.bytes(state.data(), state.size());
  w.end_record();
  append_record(w);
}

std::pair<std::string, uint64_t> take_batch() {
  Batch& b = batch();
  std::lock_guard<std::mutex> lock(b.mutex);
  std::pair<std::string, uint64_t> taken{std::move(b.data), b.records};
  b.data = std::string();
  b.records = 0;
  return taken;
}

uint64_t pending_records() {
  Batch& b = batch();
  std::lock_guard<std::mutex> lock(b.mutex);
  return b.records;
}

// ---- the op name table --------------------------------------------------------------

namespace {

struct Names {
  std::mutex mutex;
  std::unordered_map<c10::OperatorHandle, uint32_t> by_op;
  std::unordered_map<std::string, uint32_t> by_name;
  std::vector<std::string> names;

  uint32_t add(const std::string& name) {
    auto found = by_name.find(name);
    if (found != by_name.end()) return found->second;
    const auto id = static_cast<uint32_t>(names.size());
    names.push_back(name);
    by_name.emplace(name, id);
    return id;
  }
};

Names& names() {
  static Names* n = new Names();
  return *n;
}

std::string full_name(const c10::OperatorHandle& op) {
  const auto& name = op.operator_name();
  return name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
}

}  // namespace

uint32_t intern(const c10::OperatorHandle& op) {
  Names& n = names();
  std::lock_guard<std::mutex> lock(n.mutex);
  auto found = n.by_op.find(op);
  if (found != n.by_op.end()) return found->second;
  const uint32_t id = n.add(full_name(op));
  n.by_op.emplace(op, id);
  return id;
}

uint32_t intern_name(const std::string& name) {
  Names& n = names();
  std::lock_guard<std::mutex> lock(n.mutex);
  return n.add(name);
}

std::vector<std::string> op_names() {
  Names& n = names();
  std::lock_guard<std::mutex> lock(n.mutex);
  return n.names;
}

// ---- early flushes ------------------------------------------------------------------

namespace {
struct Flush {
  FlushHook hook;
  std::atomic<uint64_t> nbytes{0};  // 0: never early
};
Flush& flush_state() {
  static Flush* f = new Flush();
  return *f;
}
thread_local bool flushing = false;  // the hook's own work must not flush again
}  // namespace

void set_flush_hook(FlushHook hook, uint64_t nbytes) {
  Flush& f = flush_state();
  f.nbytes = 0;
  f.hook = std::move(hook);
  f.nbytes = f.hook ? nbytes : 0;
}

void maybe_flush() {
  Flush& f = flush_state();
  const uint64_t limit = f.nbytes.load(std::memory_order_relaxed);
  if (limit == 0 || flushing) return;
  {
    Batch& b = batch();
    std::lock_guard<std::mutex> lock(b.mutex);
    if (b.data.size() < limit) return;
  }
  flushing = true;
  try {
    f.hook();
  } catch (...) {
    flushing = false;
    throw;
  }
  flushing = false;
}

// ---- readback -----------------------------------------------------------------------

namespace {
// A hook set from Python; never destroyed, since Python may be gone at exit.
template <typename Hook>
Hook& slot() {
  static Hook* h = new Hook();
  return *h;
}

ReadbackHook& hook() { return slot<ReadbackHook>(); }
SyncHook& sync_hook() { return slot<SyncHook>(); }
}  // namespace

void set_readback_hook(ReadbackHook h) { hook() = std::move(h); }
void set_sync_hook(SyncHook h) { sync_hook() = std::move(h); }

std::string sync() {
  TORCH_CHECK(sync_hook(), "cumulus: this op's outputs need an executor, and none is attached");
  return sync_hook()();
}

namespace {

void read_back_piece(const at::Tensor& src, const at::Tensor& dst) {
  Writer w;
  w.begin_record(Kind::Readback);
  put_tensor_ref(w, src);
  w.end_record();
  append_record(w);
  TORCH_CHECK(hook(),
              "cumulus: reading a tensor back needs an executor, and none is attached "
              "(the native device only records ops so far)");
  hook()(src, dst);
}

}  // namespace

// A large readback comes piece by piece, each its own round trip, from a contiguous
// device tensor (src itself when it is one) into a contiguous host tensor of src's
// dtype (dst itself when it is one), then into dst.
void read_back(const at::Tensor& src, const at::Tensor& dst) {
  if (src.nbytes() <= static_cast<size_t>(kPieceBytes) || !src.sizes().equals(dst.sizes())) {
    read_back_piece(src, dst);
    return;
  }
  const at::Tensor whole = src.contiguous();
  const bool direct = dst.is_contiguous() && dst.scalar_type() == src.scalar_type();
  const at::Tensor host = direct ? dst : at::empty(src.sizes(), dst.options().dtype(src.dtype()));
  for_each_piece(whole.view(-1), host.view(-1), read_back_piece);
  if (!direct) dst.copy_(host);
}

}  // namespace cumulus
