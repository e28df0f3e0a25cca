// The executor's replay loop: runs one batch of wire records (record.h) in C++.
//
// Theory of operation
// -------------------
// A `Replayer` is one session's state on the executor: a table `handle -> storage`
// (one entry per remote storage the client created), the bytes those storages hold
// against a quota, the op name table the client has sent so far, and a cache of
// resolved operator handles. `replay(batch)` runs every record in order, and Python
// runs once per batch, never per op:
//
//   OP        the name index resolves (once per name) to a `c10::OperatorHandle`;
//             each argument is rebuilt from its wire value against the schema's type
//             (tensor references become views of the table's storages, built directly as
//             TensorImpls over the storage, without a dispatch), the op is called
//             through the dispatcher below autograd, and the declared outputs are
//             registered under the client's handles.
//   ALLOC     a new storage of `nbytes` (within quota).
//   UPLOAD    host bytes copied into a view of a storage.
//   READBACK  a view's bytes, contiguous, returned to Python in batch order.
//   FREE      the entry is dropped (its bytes leave the quota).
//   RESIZE    a storage grows in place, keeping its contents and its handle.
//   GRAPH     a compiled graph's definition, handed to the executor's Python (`set_graphs`),
//             which validates and keeps it (host/graphs.py).
//   RUN       one call of a defined graph: the inputs are rebuilt as an op's arguments are,
//             the graph runs, and its results are registered under the client's handles
//             as an op's outputs are. Python prepares a graph once (`set_program`,
//             program.h) and its calls run here, node by node, without Python; a graph
//             the host compiles (--graph-compiler inductor) is run by Python instead.
//
// Eviction: the executor may set storages aside (`set_aside`: their bytes copied to host
// memory or disk by Python first). They leave the table but still count against the
// quota, and their handles stay taken. A record that names one faults it back in: the
// `fault` callback (`set_fault`) hands back its bytes, and a storage is made and filled
// here. So a batch brings back only the storages it names; a FREE of one set aside
// forgets it without bringing it back.
//
// Strictness: the executor trusts nothing in a batch. Before any record runs, the
// batch's framing is walked whole, so a truncated batch runs nothing. Each record is
// then parsed completely before it has any effect, every tensor reference is checked
// against its storage's bounds, op names must be aten overloads outside a small
// blocklist, and storages are counted against the quota before they are created.
// A record that fails has no effect (an op's outputs are registered all together or
// not at all) and stops the batch: the records before it stay applied, those after it
// do not run, and Python gets a `ReplayError` naming the record's index, its kind
// ("malformed", "unknown_handle", "unknown_op", "out_of_memory", "op_failed",
// "poisoned_handle") and why.
//
// The headers are the ones used, not <torch/extension.h>: that one brings torch's whole
// C++ frontend (nn, optim, data) and tripled this file's compile time.
#include <torch/csrc/utils/pybind.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "program.h"
#include "record.h"

namespace cumulus {
namespace {

// ---- errors ---------------------------------------------------------------------------

// A record that cannot run: `kind` says which rule it broke.
struct Failure {
  std::string kind;
  std::string message;
};

[[noreturn]] void fail(const char* kind, const std::string& message) {
  throw Failure{kind, message};
}

// What Python sees: the failing record's index in the batch, its kind and why.
struct ReplayError : std::exception {
  ReplayError(int64_t record, std::string kind, std::string message)
      : record(record), kind(std::move(kind)), message(std::move(message)) {}
  const char* what() const noexcept override { return message.c_str(); }
  int64_t record;
  std::string kind;
  std::string message;
};

// ---- reading --------------------------------------------------------------------------

// A bounds-checked cursor over one record's body (or the batch's framing).
class Cursor {
 public:
  Cursor(const char* data, size_t size) : data_(data), size_(size) {}

  template <typename T>
  T take() {
    T value;
    std::memcpy(&value, raw(sizeof(T)), sizeof(T));
    return value;
  }
  const char* raw(size_t n) {
    if (n > size_ - at_) {
      fail("malformed", "record truncated at byte " + std::to_string(at_) + " of " +
                            std::to_string(size_));
    }
    const char* p = data_ + at_;
    at_ += n;
    return p;
  }
  size_t left() const { return size_ - at_; }

 private:
  const char* data_;
  size_t size_;
  size_t at_ = 0;
};

// The dtypes a tensor may have on the wire: c10::ScalarType codes of plain numbers.
c10::ScalarType wire_dtype(uint8_t code) {
  using S = c10::ScalarType;
  switch (static_cast<S>(code)) {
    case S::Byte: case S::Char: case S::Short: case S::Int: case S::Long:
    case S::Half: case S::Float: case S::Double: case S::ComplexHalf:
    case S::ComplexFloat: case S::ComplexDouble: case S::Bool: case S::BFloat16:
    case S::UInt16: case S::UInt32: case S::UInt64:
      return static_cast<S>(code);
    default:
      fail("malformed", "unknown dtype code " + std::to_string(code));
  }
}

constexpr uint8_t kMaxDims = 64;

// A tensor reference as it came: which storage, and the view of it.
struct Ref {
  uint64_t handle = 0;
  int64_t offset = 0;
  c10::ScalarType dtype = c10::ScalarType::Float;
  c10::SmallVector<int64_t, 6> sizes, strides;
};

std::vector<int64_t> read_ints(Cursor& c, size_t n) {
  std::vector<int64_t> out(n);
  if (n) std::memcpy(out.data(), c.raw(n * sizeof(int64_t)), n * sizeof(int64_t));
  return out;
}

Ref read_ref(Cursor& c) {
  Ref r;
  r.handle = c.take<uint64_t>();
  r.offset = c.take<int64_t>();
  r.dtype = wire_dtype(c.take<uint8_t>());
  const uint8_t ndim = c.take<uint8_t>();
  if (ndim > kMaxDims) fail("malformed", "a tensor of " + std::to_string(ndim) + " dims");
  r.sizes.resize(ndim);
  r.strides.resize(ndim);
  for (auto& s : r.sizes) s = c.take<int64_t>();
  for (auto& s : r.strides) s = c.take<int64_t>();
  return r;
}

// The bytes of storage a view reaches, from the storage's start. Negative sizes,
// strides or offsets and arithmetic overflow are malformed: they could only name
// memory outside the storage.
uint64_t extent_bytes(const Ref& r) {
  if (r.offset < 0) fail("malformed", "a negative storage offset");
  uint64_t last = static_cast<uint64_t>(r.offset);
  bool empty = false;
  for (size_t i = 0; i < r.sizes.size(); ++i) {
    if (r.sizes[i] < 0 || r.strides[i] < 0) fail("malformed", "a negative size or stride");
    if (r.sizes[i] == 0) empty = true;
    uint64_t reach = 0;
    if (r.sizes[i] > 0 &&
        (__builtin_mul_overflow(static_cast<uint64_t>(r.sizes[i] - 1),
                                static_cast<uint64_t>(r.strides[i]), &reach) ||
         __builtin_add_overflow(last, reach, &last))) {
      fail("malformed", "a view whose extent overflows");
    }
  }
  if (empty) return 0;
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(last + 1, c10::elementSize(r.dtype), &bytes)) {
    fail("malformed", "a view whose extent overflows");
  }
  return bytes;
}

// A host tensor sent by value: a fresh CPU tensor holding the record's bytes.
at::Tensor read_host_tensor(Cursor& c) {
  const c10::ScalarType dtype = wire_dtype(c.take<uint8_t>());
  const uint8_t ndim = c.take<uint8_t>();
  if (ndim > kMaxDims) fail("malformed", "a host tensor of " + std::to_string(ndim) + " dims");
  const std::vector<int64_t> sizes = read_ints(c, ndim);
  uint64_t want = c10::elementSize(dtype);
  for (int64_t s : sizes) {
    if (s < 0 || __builtin_mul_overflow(want, static_cast<uint64_t>(s), &want)) {
      fail("malformed", "a host tensor with a bad size");
    }
  }
  const uint64_t nbytes = c.take<uint64_t>();
  if (nbytes != want) {
    fail("malformed", "a host tensor of " + std::to_string(nbytes) + " bytes where its shape "
                      "needs " + std::to_string(want));
  }
  const char* bytes = c.raw(nbytes);
  at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(dtype).device(c10::kCPU));
  if (nbytes) std::memcpy(t.data_ptr(), bytes, nbytes);
  return t;
}

// Ops that reach past the session's own tensors (files, process state), or rebind or
// restride a tensor in place behind the client's picture of it; as
// cumulus_p2p/wire/ops.py's BLOCKED.
const std::unordered_set<std::string>& blocked() {
  static const auto* names = new std::unordered_set<std::string>{
      "from_file", "_print", "set_", "resize_", "resize_as_", "_resize_output_",
      "as_strided_", "squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_",
      "swapaxes_", "_set_grad_enabled", "_cufft_clear_plan_cache",
      "_cufft_set_plan_cache_max_size"};
  return *names;
}

// ---- the session ----------------------------------------------------------------------

struct Entry {
  c10::Storage storage;
  uint64_t nbytes;  // as counted against the quota
  uint64_t used;    // the last batch that named it (eviction takes the longest unused)
};

// One output the client declared, matched to the op's result: return `ret`, and element
// `elem` of it when the return is a tensor list (-1 otherwise).
struct DeclaredOut {
  size_t ret;
  int64_t elem;
  Ref ref;
};

class Replayer {
 public:
  Replayer(const std::string& device, int64_t quota_bytes)
      : device_(device), quota_(quota_bytes) {
    TORCH_CHECK(quota_bytes >= 0, "the quota must be at least 0 bytes");
    keys_ = c10::DispatchKeySet(c10::computeDispatchKey(std::nullopt, std::nullopt, device_));
    // The session's generator, for random ops whose generator argument the client left
    // unset; other device types use the device's default generator in this slice.
    if (device_.is_cpu()) generator_ = at::detail::createCPUGenerator();
  }

  // Runs `batch` after appending `names` to the op name table; the readbacks' bytes in
  // batch order. Raises ReplayError (see the file comment).
  std::vector<std::string> replay(const std::string& batch, const std::vector<std::string>& names) {
    for (const auto& name : names) {
      names_.push_back(name);
      ops_.emplace_back();
    }
    const auto records = frame(batch);
    batches_ += 1;
    // Below autograd: the executor replays what the client's autograd already decided.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::vector<std::string> readbacks;
    for (size_t i = 0; i < records.size(); ++i) {
      const auto& [kind, body, length] = records[i];
      current_op_.clear();
      touched_.clear();
      try {
        Cursor c(body, length);
        run_record(kind, c, readbacks);
        if (c.left() != 0) fail("malformed", std::to_string(c.left()) + " stray bytes");
      } catch (const Failure& f) {
        throw ReplayError(static_cast<int64_t>(i), f.kind, describe(i, kind) + ": " + f.message);
      } catch (const c10::Error& e) {
        throw ReplayError(static_cast<int64_t>(i), "op_failed",
                          describe(i, kind) + ": " + e.what_without_backtrace());
      } catch (const std::exception& e) {
        throw ReplayError(static_cast<int64_t>(i), "op_failed", describe(i, kind) + ": " + e.what());
      }
    }
    return readbacks;
  }

  // Compiled graphs are the executor's Python's (host/graphs.py): `define` keeps a GRAPH's
  // definition, `run` calls a graph on its inputs within `budget` bytes of intermediates
  // and returns its results. Each raises Failure for a graph or a call that breaks a
  // rule. Unset, GRAPH and RUN records fail as unknown ops.
  using DefineGraph = std::function<void(uint32_t graph, const std::string& definition)>;
  using RunGraph = std::function<std::vector<std::optional<at::Tensor>>(
      uint32_t graph, const std::vector<std::optional<at::Tensor>>& inputs, int64_t budget)>;
  void set_graphs(DefineGraph define, RunGraph run) {
    define_graph_ = std::move(define);
    run_graph_ = std::move(run);
  }
  // Graph `graph`'s calls run `program` here from now on, not the `run` callback.
  void set_program(uint32_t graph, Program program) {
    programs_.insert_or_assign(graph, std::make_shared<const Program>(std::move(program)));
  }

  size_t programs() const { return programs_.size(); }
  std::string device() const { return device_.str(); }
  int64_t live_bytes() const { return static_cast<int64_t>(live_); }
  int64_t away_bytes() const { return static_cast<int64_t>(away_bytes_); }
  int64_t quota_bytes() const { return quota_; }
  uint64_t ops_run() const { return ops_run_; }
  // The live handles, those no batch named for longest first.
  std::vector<uint64_t> coldest() const {
    std::vector<std::pair<uint64_t, uint64_t>> by_use;
    for (const auto& [h, e] : table_) by_use.emplace_back(e.used, h);
    std::sort(by_use.begin(), by_use.end());
    std::vector<uint64_t> out;
    for (const auto& [used, h] : by_use) out.push_back(h);
    return out;
  }
  std::vector<uint64_t> handles() const {
    std::vector<uint64_t> out;
    for (const auto& [h, e] : table_) out.push_back(h);
    std::sort(out.begin(), out.end());
    return out;
  }
  // The handles set aside, sorted.
  std::vector<uint64_t> away() const {
    std::vector<uint64_t> out;
    for (const auto& [h, nbytes] : away_) out.push_back(h);
    std::sort(out.begin(), out.end());
    return out;
  }

  // Take `handles`' storages out of the table: their device memory goes once nothing else
  // holds it; they still count against the quota until freed or put back.
  void set_aside(const std::vector<uint64_t>& handles) {
    for (uint64_t h : handles) TORCH_CHECK(table_.count(h), "no storage with handle ", h);
    for (uint64_t h : handles) {
      auto found = table_.find(h);
      const uint64_t nbytes = found->second.nbytes;
      live_ -= nbytes;
      away_bytes_ += nbytes;
      away_.emplace(h, nbytes);
      table_.erase(found);
    }
  }

  // Make a storage set aside again, filled from `bytes` (flat uint8, any device). Bytes
  // already on the device, in a storage of their own, become the storage without a copy.
  void put_back(uint64_t handle, const at::Tensor& bytes) {
    auto found = away_.find(handle);
    TORCH_CHECK(found != away_.end(), "storage ", handle, " is not set aside");
    const uint64_t nbytes = found->second;
    TORCH_CHECK(bytes.scalar_type() == at::kByte && bytes.dim() == 1 &&
                    static_cast<uint64_t>(bytes.numel()) == nbytes,
                "storage ", handle, " needs ", nbytes, " bytes back");
    at::Tensor storage = bytes;
    const bool adoptable = bytes.device() == device_ && bytes.is_contiguous() &&
                           bytes.storage_offset() == 0 && bytes.storage().nbytes() == nbytes;
    if (!adoptable) {  // from host memory to a GPU, say: a storage of its own, filled
      storage = at::empty({static_cast<int64_t>(nbytes)},
                          at::TensorOptions().dtype(at::kByte).device(device_));
      storage.copy_(bytes);
    }
    away_.erase(found);
    away_bytes_ -= nbytes;
    add(handle, storage.storage());
  }

  // Where a record's storage set aside comes from: its bytes. Called without the GIL.
  using Fault = std::function<at::Tensor(uint64_t handle)>;
  void set_fault(Fault fault) { fault_ = std::move(fault); }

  // A storage's bytes as a flat uint8 tensor on its device, sharing its memory: what a
  // checkpoint names (a CPU storage is hashed where it lies, without a copy).
  at::Tensor storage_view(uint64_t handle) const {
    auto found = table_.find(handle);
    TORCH_CHECK(found != table_.end(), "no storage with handle ", handle);
    const c10::Storage& s = found->second.storage;
    return over(s, c10::ScalarType::Byte, {static_cast<int64_t>(s.nbytes())}, {1}, 0);
  }

 private:
  // ---- framing ----

  struct Framed {
    Kind kind;
    const char* body;
    size_t length;
  };

  // Every record's (kind, body), checked before any runs: a truncated batch runs nothing.
  static std::vector<Framed> frame(const std::string& batch) {
    std::vector<Framed> out;
    size_t at = 0;
    while (at < batch.size()) {
      if (batch.size() - at < 5) {
        throw ReplayError(static_cast<int64_t>(out.size()), "malformed",
                          "record " + std::to_string(out.size()) + ": truncated header");
      }
      const auto kind = static_cast<uint8_t>(batch[at]);
      uint32_t length;
      std::memcpy(&length, batch.data() + at + 1, sizeof(length));
      if (length > batch.size() - at - 5) {
        throw ReplayError(static_cast<int64_t>(out.size()), "malformed",
                          "record " + std::to_string(out.size()) + ": body of " +
                              std::to_string(length) + " bytes truncated to " +
                              std::to_string(batch.size() - at - 5));
      }
      if (kind < static_cast<uint8_t>(Kind::Op) || kind > static_cast<uint8_t>(Kind::Run)) {
        throw ReplayError(static_cast<int64_t>(out.size()), "malformed",
                          "record " + std::to_string(out.size()) + ": unknown kind " +
                              std::to_string(kind));
      }
      out.push_back({static_cast<Kind>(kind), batch.data() + at + 5, length});
      at += 5 + length;
    }
    return out;
  }

  std::string describe(size_t index, Kind kind) const {
    static const char* kinds[] = {"?",      "op",  "alloc", "upload",  "readback", "free",
                                  "resize", "dyn", "seed",  "rng_get", "rng_set",  "graph",
                                  "run"};
    std::string out = "record " + std::to_string(index) + " (" +
                      kinds[static_cast<uint8_t>(kind)];
    if (!current_op_.empty()) out += " " + current_op_;
    return out + ")";
  }

  // ---- records ----

  // A GPU session draws from its device's default generator (its worker's own).
  at::Generator session_generator() const {
    return generator_.defined() ? generator_ : at::globalContext().defaultGenerator(device_);
  }

  void run_record(Kind kind, Cursor& c, std::vector<std::string>& readbacks) {
    switch (kind) {
      case Kind::Op:
        run_op(c);
        return;
      case Kind::Dyn:
        readbacks.push_back(run_dyn(c));
        return;
      case Kind::Graph: {
        const uint32_t graph = c.take<uint32_t>();
        const uint32_t n = c.take<uint32_t>();
        const std::string definition(c.raw(n), n);
        end(c);
        if (!define_graph_) fail("unknown_op", "this executor runs no compiled graphs");
        define_graph_(graph, definition);
        return;
      }
      case Kind::Run:
        run_graph(c);
        return;
      case Kind::Seed: {
        const uint64_t seed = c.take<uint64_t>();
        end(c);
        at::Generator g = session_generator();
        std::lock_guard<std::mutex> lock(g.mutex());
        g.set_current_seed(seed);
        return;
      }
      case Kind::RngGet: {
        end(c);
        at::Generator g = session_generator();
        std::lock_guard<std::mutex> lock(g.mutex());
        const at::Tensor state = g.get_state();
        readbacks.emplace_back(static_cast<const char*>(state.const_data_ptr()),
                               static_cast<size_t>(state.nbytes()));
        return;
      }
      case Kind::RngSet: {
        const uint32_t n = c.take<uint32_t>();
        const char* bytes = c.raw(n);
        end(c);
        at::Tensor state = at::empty({static_cast<int64_t>(n)}, at::kByte);
        if (n) std::memcpy(state.data_ptr(), bytes, n);
        at::Generator g = session_generator();
        std::lock_guard<std::mutex> lock(g.mutex());
        try {
          g.set_state(state);
        } catch (const c10::Error& e) {
          fail("malformed", std::string("not a generator state: ") + e.what_without_backtrace());
        }
        return;
      }
      case Kind::Alloc: {
        const uint64_t handle = c.take<uint64_t>();
        const uint64_t nbytes = c.take<uint64_t>();
        end(c);
        check_new_handle(handle);
        reserve(nbytes);
        add(handle, at::empty({static_cast<int64_t>(nbytes)},
                              at::TensorOptions().dtype(at::kByte).device(device_))
                        .storage());
        return;
      }
      case Kind::Upload: {
        const at::Tensor dst = tensor(c, "an upload's destination");
        expect_tag(c, Tag::HostTensor, "an upload's source");
        const at::Tensor src = read_host_tensor(c);
        end(c);
        dst.copy_(src);
        return;
      }
      case Kind::Readback: {
        const at::Tensor viewed = tensor(c, "a readback's source");
        end(c);
        const at::Tensor src = viewed.resolve_conj().resolve_neg().contiguous().to(c10::kCPU);
        readbacks.emplace_back(static_cast<const char*>(src.const_data_ptr()), src.nbytes());
        return;
      }
      case Kind::Free: {
        const uint64_t handle = c.take<uint64_t>();
        end(c);
        if (poisoned_.erase(handle)) return;
        if (auto away = away_.find(handle); away != away_.end()) {  // forgotten where it is
          away_bytes_ -= away->second;
          away_.erase(away);
          return;
        }
        auto found = table_.find(handle);
        if (found == table_.end()) fail("unknown_handle", "no storage with handle " + std::to_string(handle));
        live_ -= found->second.nbytes;
        table_.erase(found);
        return;
      }
      case Kind::Resize: {
        const uint64_t handle = c.take<uint64_t>();
        const uint64_t nbytes = c.take<uint64_t>();
        end(c);
        Entry& e = entry(handle);
        if (nbytes <= e.storage.nbytes()) return;
        reserve(nbytes - e.nbytes);
        // A byte tensor over the storage, resized: the storage grows in place (same
        // StorageImpl, so every view of it follows), as resize_ does on any device.
        over(e.storage, at::kByte, {static_cast<int64_t>(e.storage.nbytes())}, {1}, 0)
            .resize_({static_cast<int64_t>(nbytes)});
        recount(e);
        return;
      }
    }
  }

  // A record is parsed whole before it has any effect: bytes left over are malformed.
  static void end(const Cursor& c) {
    if (c.left() != 0) fail("malformed", std::to_string(c.left()) + " stray bytes");
  }

  static void expect_tag(Cursor& c, Tag tag, const char* what) {
    const auto got = c.take<uint8_t>();
    if (got != static_cast<uint8_t>(tag)) {
      fail("malformed", std::string(what) + " has value tag " + std::to_string(got));
    }
  }

  // ---- the table ----

  void check_new_handle(uint64_t handle) const {
    if (handle == 0) fail("malformed", "handle 0 names no storage");
    if (table_.count(handle) || away_.count(handle) || poisoned_.count(handle)) {
      fail("malformed", "handle " + std::to_string(handle) + " is already in use");
    }
  }

  Entry& entry(uint64_t handle) {
    auto found = table_.find(handle);
    if (found != table_.end()) return found->second;
    if (away_.count(handle)) return fault_in(handle);
    auto poisoned = poisoned_.find(handle);
    if (poisoned != poisoned_.end()) fail("poisoned_handle", poisoned->second);
    fail("unknown_handle", "no storage with handle " + std::to_string(handle));
  }

  // A storage set aside, back in the table from the bytes `fault_` hands back.
  Entry& fault_in(uint64_t handle) {
    if (!fault_) fail("unknown_handle", "storage " + std::to_string(handle) + " is set aside");
    const at::Tensor bytes = fault_(handle);
    try {
      put_back(handle, bytes);
    } catch (const c10::Error& e) {
      fail("evicted", e.what_without_backtrace());
    }
    return table_.at(handle);
  }

  // Whether `more` bytes fit under the quota now; throws out_of_memory if not. Storages
  // set aside count: they come back when named.
  void reserve(uint64_t more) const {
    const uint64_t held = live_ + away_bytes_;
    if (more > static_cast<uint64_t>(quota_) || held > static_cast<uint64_t>(quota_) - more) {
      fail("out_of_memory", "needs " + std::to_string(more) + " more bytes; the session holds " +
                                std::to_string(held) + " of its quota of " +
                                std::to_string(quota_));
    }
  }

  void add(uint64_t handle, c10::Storage storage) {
    const uint64_t nbytes = storage.nbytes();
    table_.emplace(handle, Entry{std::move(storage), nbytes, batches_});
    live_ += nbytes;
  }

  // An op may have grown a storage in place (an out= argument resized).
  void recount(Entry& e) {
    const uint64_t now = e.storage.nbytes();
    live_ = live_ - e.nbytes + now;
    e.nbytes = now;
  }

  // A tensor over `storage` with the given geometry, built directly: a dispatch per
  // argument (as_strided) would cost as much as the op itself at small sizes.
  at::Tensor over(const c10::Storage& storage, c10::ScalarType dtype, c10::IntArrayRef sizes,
                  c10::IntArrayRef strides, int64_t offset) const {
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(storage), keys_,
                                                     c10::scalarTypeToTypeMeta(dtype));
    impl->set_sizes_and_strides(sizes, strides, offset);
    return at::Tensor(std::move(impl));
  }

  // The view a reference names, checked against its storage's bounds.
  at::Tensor view(const Ref& r) {
    Entry& e = entry(r.handle);
    const uint64_t extent = extent_bytes(r);
    if (extent > e.storage.nbytes()) {
      fail("malformed", "a view of " + std::to_string(extent) + " bytes of storage " +
                            std::to_string(r.handle) + ", which holds " +
                            std::to_string(e.storage.nbytes()));
    }
    touched_.push_back(&e);
    e.used = batches_;
    return over(e.storage, r.dtype, r.sizes, r.strides, r.offset);
  }

  // A TENSOR_BITS value after its tag: the view, lazily conjugated or negated.
  at::Tensor with_bits(Cursor& c) {
    const uint8_t bits = c.take<uint8_t>();
    if (bits & ~(kConjBit | kNegBit)) fail("malformed", "unknown tensor bits " + std::to_string(bits));
    at::Tensor t = view(read_ref(c));
    if (bits & kConjBit) t = t._conj();
    if (bits & kNegBit) t = t._neg_view();
    return t;
  }

  // A tensor value where only a device tensor will do (an upload's destination, a
  // readback's source), with its bits if it has any.
  at::Tensor tensor(Cursor& c, const char* what) {
    const auto got = c.take<uint8_t>();
    if (got == static_cast<uint8_t>(Tag::Tensor)) return view(read_ref(c));
    if (got == static_cast<uint8_t>(Tag::TensorBits)) return with_bits(c);
    fail("malformed", std::string(what) + " has value tag " + std::to_string(got));
  }

  // ---- ops ----

  const c10::OperatorHandle& resolve(uint32_t index) {
    if (index >= names_.size()) {
      fail("malformed", "op index " + std::to_string(index) + " is not in the name table");
    }
    current_op_ = names_[index];
    auto& cached = ops_[index];
    if (cached) return *cached;
    const std::string& name = names_[index];
    if (name.rfind("aten::", 0) != 0) fail("unknown_op", "'" + name + "' is not an aten op");
    const auto dot = name.find('.');
    const std::string base = name.substr(6, dot == std::string::npos ? std::string::npos : dot - 6);
    const std::string overload = dot == std::string::npos ? "" : name.substr(dot + 1);
    if (base.empty() || blocked().count(base)) {
      fail("unknown_op", "'" + name + "' is not allowed on an executor");
    }
    auto op = c10::Dispatcher::singleton().findSchema({"aten::" + base, overload});
    if (!op) fail("unknown_op", "no aten op named '" + name + "'");
    cached = *op;
    return *cached;
  }

  // One wire value as the schema type `type` wants it.
  c10::IValue value(Cursor& c, const c10::TypePtr& type) {
    const auto tag = static_cast<Tag>(c.take<uint8_t>());
    c10::TypePtr inner = type;
    if (auto optional = type->cast<c10::OptionalType>()) inner = optional->getElementType();
    switch (tag) {
      case Tag::None:
        // An unset generator draws from the session's, never the executor process's.
        if (inner->kind() == c10::TypeKind::GeneratorType && generator_.defined()) {
          return generator_;
        }
        // Autograd hands a backward undefined tensors where the schema wants a Tensor
        // (a fused attention's absent bias): the client writes them as None.
        if (type->kind() == c10::TypeKind::TensorType) return at::Tensor();
        return c10::IValue();
      case Tag::Tensor:
        return view(read_ref(c));
      case Tag::TensorBits:
        return with_bits(c);
      case Tag::HostTensor:
        return read_host_tensor(c);
      case Tag::Number: {
        const at::Tensor number = read_host_tensor(c);
        if (number.dim() != 0) fail("malformed", "a wrapped number of " + std::to_string(number.dim()) + " dims");
        number.unsafeGetTensorImpl()->set_wrapped_number(true);
        return number;
      }
      case Tag::Int:
        return c.take<int64_t>();
      case Tag::Double:
        return c.take<double>();
      case Tag::Bool:
        return static_cast<bool>(c.take<uint8_t>());
      case Tag::Complex: {
        const double re = c.take<double>();
        return c10::complex<double>(re, c.take<double>());
      }
      case Tag::String: {
        const uint32_t n = c.take<uint32_t>();
        return std::string(c.raw(n), n);
      }
      case Tag::List: {
        const auto list_type = inner->cast<c10::ListType>();
        if (!list_type) fail("malformed", "a list where the schema wants " + type->str());
        const uint32_t n = c.take<uint32_t>();
        if (n > c.left()) fail("malformed", "a list longer than its record");
        // Typed as the schema says, so that the kernel's unboxing (toTensorList,
        // toDoubleList...) accepts it.
        c10::impl::GenericList list(list_type->getElementType());
        list.reserve(n);
        for (uint32_t i = 0; i < n; ++i) list.push_back(value(c, list_type->getElementType()));
        return list;
      }
      case Tag::Ints: {
        const uint32_t n = c.take<uint32_t>();
        if (n > c.left() / sizeof(int64_t)) fail("malformed", "an int list longer than its record");
        return c10::List<int64_t>(read_ints(c, n));
      }
      case Tag::Device: {
        const auto type_code = c.take<int8_t>();
        c.take<int8_t>();
        if (type_code == static_cast<int8_t>(c10::DeviceType::PrivateUse1)) return device_;
        if (type_code == static_cast<int8_t>(c10::DeviceType::CPU)) return c10::Device(c10::kCPU);
        fail("malformed", "device type " + std::to_string(type_code) + " is not cumulus or cpu");
      }
      case Tag::Generator:
        if (generator_.defined()) return generator_;
        return c10::IValue();
    }
    fail("malformed", "unknown value tag " + std::to_string(static_cast<int>(tag)));
  }

  // A declared output: a tensor reference, a list of them, or anything else (ignored).
  void read_declared(Cursor& c, size_t ret, int64_t elem, std::vector<DeclaredOut>& outs) {
    const auto tag = static_cast<Tag>(c.take<uint8_t>());
    switch (tag) {
      case Tag::Tensor:
        outs.push_back({ret, elem, read_ref(c)});
        return;
      case Tag::List: {
        if (elem >= 0) fail("malformed", "a nested list of outputs");
        const uint32_t n = c.take<uint32_t>();
        if (n > c.left()) fail("malformed", "a list longer than its record");
        for (uint32_t i = 0; i < n; ++i) read_declared(c, ret, i, outs);
        return;
      }
      // Scalars the op returned: skipped, the client already has them.
      case Tag::None: case Tag::Generator: return;
      case Tag::Int: c.take<int64_t>(); return;
      case Tag::Double: c.take<double>(); return;
      case Tag::Bool: c.take<uint8_t>(); return;
      case Tag::Complex: c.raw(16); return;
      case Tag::String: c.raw(c.take<uint32_t>()); return;
      case Tag::Device: c.raw(2); return;
      case Tag::Ints: {
        const uint32_t n = c.take<uint32_t>();
        if (n > c.left() / sizeof(int64_t)) fail("malformed", "an int list longer than its record");
        c.raw(n * sizeof(int64_t));
        return;
      }
      case Tag::HostTensor: read_host_tensor(c); return;
    }
    fail("malformed", "unknown value tag " + std::to_string(static_cast<int>(tag)));
  }

  // An op record's start, shared by OP and DYN: the op, its arguments (views of the
  // session's storages; `touched_` holds their entries) and its output count.
  struct Call {
    c10::OperatorHandle op;
    torch::jit::Stack stack;
    size_t ninputs;
    uint16_t nouts;
  };

  Call read_call(Cursor& c) {
    const c10::OperatorHandle& op = resolve(c.take<uint32_t>());
    const auto& schema = op.schema();
    const uint16_t nargs = c.take<uint16_t>();
    if (nargs != schema.arguments().size()) {
      fail("malformed", std::to_string(nargs) + " arguments where the schema has " +
                            std::to_string(schema.arguments().size()));
    }
    touched_.clear();
    torch::jit::Stack stack;
    stack.reserve(nargs);
    for (const auto& argument : schema.arguments()) stack.push_back(value(c, argument.type()));
    const uint16_t nouts = c.take<uint16_t>();
    if (nouts != schema.returns().size()) {
      fail("malformed", std::to_string(nouts) + " outputs where the schema has " +
                            std::to_string(schema.returns().size()));
    }
    return {op, std::move(stack), touched_.size(), nouts};
  }

  void run_op(Cursor& c) {
    auto [op, stack, ninputs, nouts] = read_call(c);
    std::vector<DeclaredOut> declared;
    for (size_t i = 0; i < nouts; ++i) read_declared(c, i, -1, declared);
    end(c);

    reserve(fresh_bytes(declared));
    op.callBoxed(&stack);
    ops_run_ += 1;
    // Out= arguments the op grew in place.
    for (size_t i = 0; i < ninputs; ++i) recount(*touched_[i]);
    register_outputs(stack, declared, ninputs);
  }

  // The quota before an op or a graph runs: the new storages the client expects.
  // A declared output over a storage set aside brings it back (it is not a new one).
  uint64_t fresh_bytes(const std::vector<DeclaredOut>& declared) {
    uint64_t fresh = 0;
    for (const auto& d : declared) {
      if (away_.count(d.ref.handle)) fault_in(d.ref.handle);
      if (!table_.count(d.ref.handle) && !poisoned_.count(d.ref.handle)) {
        if (d.ref.handle == 0) fail("malformed", "handle 0 names no storage");
        fresh += extent_bytes(d.ref);
      }
    }
    return fresh;
  }

  // A RUN: the graph's inputs are views of the session's storages (or host tensors), its
  // results are bound to the declared outputs as an op's are.
  void run_graph(Cursor& c) {
    const uint32_t graph = c.take<uint32_t>();
    current_op_ = "of graph " + std::to_string(graph);
    const uint16_t nargs = c.take<uint16_t>();
    std::vector<std::optional<at::Tensor>> inputs;
    inputs.reserve(nargs);
    for (uint16_t i = 0; i < nargs; ++i) {
      const c10::IValue v = value(c, c10::OptionalType::ofTensor());
      if (!v.isNone() && !v.isTensor()) fail("malformed", "a graph input that is not a tensor");
      inputs.push_back(v.isTensor() ? std::optional<at::Tensor>(v.toTensor()) : std::nullopt);
    }
    const size_t ninputs = touched_.size();
    const uint16_t nouts = c.take<uint16_t>();
    std::vector<DeclaredOut> declared;
    for (size_t i = 0; i < nouts; ++i) read_declared(c, i, -1, declared);
    end(c);
    const auto program = programs_.find(graph);
    if (program == programs_.end() && !run_graph_) {
      fail("unknown_op", "this executor runs no compiled graphs");
    }
    const uint64_t fresh = fresh_bytes(declared);
    reserve(fresh);
    const int64_t budget = quota_ - static_cast<int64_t>(live_ + away_bytes_ + fresh);
    std::vector<std::optional<at::Tensor>> results;
    {
      SessionGenerator drawing(generator_);
      if (program == programs_.end()) {
        results = run_graph_(graph, inputs, budget);
      } else {
        results = run_program(*program->second, inputs, budget, graph);
      }
    }
    ops_run_ += 1;
    if (results.size() != nouts) {
      fail("op_failed", "the graph has " + std::to_string(results.size()) + " outputs; the "
                        "call declared " + std::to_string(nouts));
    }
    for (size_t i = 0; i < ninputs; ++i) recount(*touched_[i]);
    torch::jit::Stack stack;
    for (auto& r : results) stack.push_back(r ? c10::IValue(std::move(*r)) : c10::IValue());
    register_outputs(stack, declared, ninputs);
  }

  static std::vector<std::optional<at::Tensor>> run_program(
      const Program& program, const std::vector<std::optional<at::Tensor>>& inputs,
      int64_t budget, uint32_t graph) {
    std::vector<at::Tensor> tensors;
    tensors.reserve(inputs.size());
    for (const auto& t : inputs) {
      if (!t) fail("invalid_graph", "graph " + std::to_string(graph) + " was called without one of its inputs");
      tensors.push_back(*t);
    }
    try {
      return program.run(tensors, budget, graph);
    } catch (const ProgramError& e) {
      fail(e.kind.c_str(), e.message);
    }
  }

  // The ops of a graph take no generator argument, so they draw from the device's default
  // one. On a CPU, whose sessions each have their own, the default holds the session's
  // state for the run and hands the state back after (its own is restored).
  class SessionGenerator {
   public:
    explicit SessionGenerator(at::Generator session) : session_(std::move(session)) {
      if (!session_.defined()) return;
      default_ = at::detail::getDefaultCPUGenerator();
      saved_ = state(default_);
      set(default_, state(session_));
    }
    ~SessionGenerator() {
      if (!session_.defined()) return;
      set(session_, state(default_));
      set(default_, saved_);
    }
    SessionGenerator(const SessionGenerator&) = delete;
    SessionGenerator& operator=(const SessionGenerator&) = delete;

   private:
    static at::Tensor state(at::Generator& g) {
      std::lock_guard<std::mutex> lock(g.mutex());
      return g.get_state();
    }
    static void set(at::Generator& g, const at::Tensor& state) {
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(state);
    }
    at::Generator session_, default_;
    at::Tensor saved_;
  };

  // An op only running can shape (DYN): each tensor result goes to its handle in a
  // contiguous storage of its own; the answer describes every result (record.h).
  std::string run_dyn(Cursor& c) {
    auto [op, stack, ninputs, nouts] = read_call(c);
    std::vector<uint64_t> handles(nouts);
    for (auto& handle : handles) {
      handle = c.take<uint64_t>();
      if (handle != 0) check_new_handle(handle);
    }
    end(c);
    op.callBoxed(&stack);
    ops_run_ += 1;
    for (size_t i = 0; i < ninputs; ++i) recount(*touched_[i]);
    Writer answer;
    std::vector<std::pair<uint64_t, c10::Storage>> bound;
    uint64_t bytes = 0;
    for (size_t i = 0; i < nouts; ++i) {
      const c10::IValue& v = stack.at(i);
      if (handles[i] != 0) {
        // A storage even for an undefined result: the client frees the handle later.
        at::Tensor t = v.isTensor() ? v.toTensor() : at::Tensor();
        if (t.defined()) {
          t = t.to(device_).contiguous();
          if (t.storage_offset() != 0 || t.storage().nbytes() != t.nbytes() || shares_input(t, ninputs)) {
            t = t.clone();
          }
          describe(answer, t);
          bound.emplace_back(handles[i], t.storage());
        } else {
          answer.put<uint8_t>(static_cast<uint8_t>(Tag::None));
          bound.emplace_back(handles[i], at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device_)).storage());
        }
        bytes += bound.back().second.nbytes();
      } else if (v.isTensor() && v.toTensor().defined()) {  // an out= argument, resized here
        describe(answer, v.toTensor());
      } else if (!put_plain_scalar(answer, v)) {
        // Tensors and those three scalars are the results the client reads (kernels.cpp).
        answer.put<uint8_t>(static_cast<uint8_t>(Tag::None));
      }
    }
    reserve(bytes);
    for (auto& [handle, storage] : bound) add(handle, std::move(storage));
    return answer.data();
  }

  // A tensor result as record.h's Result describes it.
  static void describe(Writer& answer, const at::Tensor& t) {
    answer.put<uint8_t>(static_cast<uint8_t>(Tag::Tensor));
    answer.put<uint8_t>(static_cast<uint8_t>(t.scalar_type()));
    answer.put<uint8_t>(static_cast<uint8_t>(t.dim()));
    for (int64_t size : t.sizes()) answer.put<int64_t>(size);
    for (int64_t stride : t.strides()) answer.put<int64_t>(stride);
    answer.put<int64_t>(t.storage_offset());
  }

  bool shares_input(const at::Tensor& t, size_t ninputs) const {
    for (size_t i = 0; i < ninputs; ++i) {
      if (touched_[i]->storage.unsafeGetStorageImpl() == t.storage().unsafeGetStorageImpl()) return true;
    }
    return false;
  }

  at::Tensor result_tensor(const torch::jit::Stack& stack, const DeclaredOut& d) const {
    const c10::IValue& v = stack.at(d.ret);
    if (d.elem < 0) {
      if (!v.isTensor()) fail("op_failed", "return " + std::to_string(d.ret) + " is not a tensor");
      return v.toTensor();
    }
    if (!v.isTensorList()) fail("op_failed", "return " + std::to_string(d.ret) + " is not a tensor list");
    const auto list = v.toTensorList();
    if (static_cast<size_t>(d.elem) >= list.size()) {
      fail("op_failed", "return " + std::to_string(d.ret) + " has fewer tensors than declared");
    }
    return list.get(d.elem);
  }

  // Binds the op's results to the client's handles, all or none.
  void register_outputs(const torch::jit::Stack& stack, const std::vector<DeclaredOut>& declared,
                        size_t ninputs) {
    struct Pending {
      uint64_t handle;
      c10::Storage storage;
    };
    std::vector<Pending> added;
    std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (into an existing view, from)
    std::vector<std::pair<uint64_t, std::string>> poison;
    uint64_t bytes = 0;
    auto is_input = [&](const c10::StorageImpl* s) {
      for (size_t i = 0; i < ninputs; ++i) {
        if (touched_[i]->storage.unsafeGetStorageImpl() == s) return true;
      }
      return false;
    };
    for (const auto& d : declared) {
      const at::Tensor result = result_tensor(stack, d);
      const Ref& r = d.ref;
      if (!result.defined() || result.sizes() != c10::IntArrayRef(r.sizes) ||
          result.scalar_type() != r.dtype) {
        // The client's meta kernel and the real one disagree (eval-mode batch_norm's
        // unused statistics): only this output is unusable, and says why when used.
        if (!table_.count(r.handle)) {
          poison.emplace_back(r.handle, "output of " + current_op_ + " has a shape or dtype the "
                                        "client did not expect; it cannot be used");
        }
        continue;
      }
      auto found = table_.find(r.handle);
      const c10::StorageImpl* storage = result.storage().unsafeGetStorageImpl();
      if (found != table_.end()) {
        // An argument's storage (in-place, out=): fine when the op wrote it there.
        if (found->second.storage.unsafeGetStorageImpl() != storage) {
          copies.emplace_back(view(r), result);
        }
        continue;
      }
      const Pending* same = nullptr;
      for (const auto& p : added) {
        if (p.handle == r.handle) same = &p;
      }
      if (same != nullptr) {  // a second output over the same new storage
        if (same->storage.unsafeGetStorageImpl() != storage) {
          fail("op_failed", "two outputs declared over one new storage are not one here");
        }
        continue;
      }
      if (result.strides() == c10::IntArrayRef(r.strides) && result.storage_offset() == r.offset &&
          result.device() == device_ && !is_input(storage)) {
        added.push_back({r.handle, result.storage()});
      } else {
        // Keep the client's picture true: lay the result out exactly as it expects, in a
        // storage of its own (an output aliasing an input would make two handles share
        // one storage).
        const uint64_t extent = extent_bytes(r);
        at::Tensor laid = over(at::empty({static_cast<int64_t>(extent)},
                                         at::TensorOptions().dtype(at::kByte).device(device_))
                                   .storage(),
                               r.dtype, r.sizes, r.strides, r.offset);
        laid.copy_(result);
        added.push_back({r.handle, laid.storage()});
      }
      bytes += added.back().storage.nbytes();
    }
    reserve(bytes);
    for (auto& [into, from] : copies) into.copy_(from);
    for (auto& p : added) add(p.handle, std::move(p.storage));
    for (auto& [handle, why] : poison) poisoned_.emplace(handle, std::move(why));
  }

  c10::Device device_;
  c10::DispatchKeySet keys_;
  int64_t quota_;
  uint64_t live_ = 0;
  uint64_t ops_run_ = 0;
  uint64_t batches_ = 0;
  std::unordered_map<uint64_t, Entry> table_;
  std::unordered_map<uint64_t, std::string> poisoned_;
  std::unordered_map<uint64_t, uint64_t> away_;  // handles set aside -> their bytes
  uint64_t away_bytes_ = 0;
  Fault fault_;
  std::vector<std::string> names_;
  std::vector<std::optional<c10::OperatorHandle>> ops_;
  at::Generator generator_;
  std::vector<Entry*> touched_;  // the current op's tensor arguments, in order
  std::string current_op_;
  DefineGraph define_graph_;
  RunGraph run_graph_;
  std::unordered_map<uint32_t, std::shared_ptr<const Program>> programs_;
};

// A Python exception a graph callback raised, as the Failure it stands for: its `kind`
// attribute (errors.ReplayError's) or op_failed, and its message.
[[noreturn]] void fail_from(py::error_already_set& e) {
  std::string kind = "op_failed";
  if (py::hasattr(e.value(), "kind")) kind = py::str(e.value().attr("kind"));
  const std::string message = py::str(e.value());
  fail(kind.c_str(), message);
}

}  // namespace
}  // namespace cumulus

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using cumulus::Replayer;
  m.doc() = "The executor's replay loop for the native cumulus device's batches.";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const cumulus::ReplayError& e) {
      py::object cls = py::module_::import("cumulus_p2p.native.errors").attr("ReplayError");
      py::object exc = cls(e.message, e.record, e.kind);
      PyErr_SetObject(cls.ptr(), exc.ptr());
    }
  });
  m.def(
      "calls_graph",
      [](const py::buffer& batch) {
        // Only the records' headers are read: a malformed batch says no (replay refuses it).
        const py::buffer_info info = batch.request();
        const auto* data = static_cast<const char*>(info.ptr);
        const auto size = static_cast<size_t>(info.size * info.itemsize);
        for (size_t at = 0; size - at >= 5;) {
          if (data[at] == static_cast<char>(cumulus::Kind::Run)) return true;
          uint32_t length;
          std::memcpy(&length, data + at + 1, sizeof(length));
          if (length > size - at - 5) return false;
          at += 5 + length;
        }
        return false;
      },
      py::arg("batch"), "Whether a batch holds a RUN record (a compiled graph's call).");
  py::class_<Replayer>(m, "Replayer")
      .def(py::init<const std::string&, int64_t>(), py::arg("device"), py::arg("quota_bytes"))
      .def(
          "replay",
          [](Replayer& r, const py::bytes& batch, const std::vector<std::string>& names) {
            std::string data = batch;  // one copy per batch; the loop runs without the GIL
            std::vector<std::string> out;
            {
              py::gil_scoped_release released;
              out = r.replay(data, names);
            }
            py::list readbacks;
            for (const auto& bytes : out) readbacks.append(py::bytes(bytes));
            return readbacks;
          },
          py::arg("batch"), py::arg("names") = std::vector<std::string>{},
          "Run a batch after appending `names` to the op name table; the readbacks' bytes.")
      .def(
          "set_graphs",
          [](Replayer& r, py::object define, py::object run) {
            // Called from the replay loop without the GIL: each call takes it.
            auto on_define = std::make_shared<py::object>(std::move(define));
            auto on_run = std::make_shared<py::object>(std::move(run));
            r.set_graphs(
                [on_define](uint32_t graph, const std::string& definition) {
                  py::gil_scoped_acquire gil;
                  try {
                    (*on_define)(graph, py::bytes(definition));
                  } catch (py::error_already_set& e) {
                    cumulus::fail_from(e);
                  }
                },
                [on_run](uint32_t graph, const std::vector<std::optional<at::Tensor>>& inputs,
                         int64_t budget) {
                  py::gil_scoped_acquire gil;
                  try {
                    return (*on_run)(graph, inputs, budget)
                        .cast<std::vector<std::optional<at::Tensor>>>();
                  } catch (py::error_already_set& e) {
                    cumulus::fail_from(e);
                  }
                });
          },
          py::arg("define"), py::arg("run"),
          "Hand GRAPH records to define(graph, definition) and RUN records to "
          "run(graph, inputs, budget), which returns the graph's outputs; either raises "
          "ReplayError(message, -1, kind) to fail the record.")
      .def(
          "set_program",
          [](Replayer& r, uint32_t graph, const py::list& nodes, const py::list& outputs,
             int64_t n_inputs, int64_t factory_bytes) {
            try {
              r.set_program(graph,
                            cumulus::Program::from_python(nodes, outputs, n_inputs, factory_bytes));
            } catch (const cumulus::ProgramError& e) {
              throw py::value_error(e.message);
            }
          },
          py::arg("graph"), py::arg("nodes"), py::arg("outputs"), py::arg("n_inputs"),
          py::arg("factory_bytes"),
          "Run graph `graph`'s calls in C++ from now on: its nodes prepared as program.h "
          "says. Raises ValueError for a node it cannot take.")
      .def_property_readonly("programs", &Replayer::programs,
                             "Graphs whose calls run in C++ (set_program).")
      .def_property_readonly("device", &Replayer::device)
      .def_property_readonly("live_bytes", &Replayer::live_bytes)
      .def_property_readonly("away_bytes", &Replayer::away_bytes,
                             "Bytes of the storages set aside (still under the quota).")
      .def("away", &Replayer::away, "The handles set aside, sorted.")
      .def("set_aside", &Replayer::set_aside, py::arg("handles"),
           "Take these storages out of the table, still counted against the quota, until a "
           "record names one (then `fault` brings it back) or `put_back`.")
      .def("put_back", &Replayer::put_back, py::arg("handle"), py::arg("bytes"),
           "Make a storage set aside again, filled from flat uint8 `bytes`.")
      .def(
          "set_fault",
          [](Replayer& r, py::object fault) {
            auto call = std::make_shared<py::object>(std::move(fault));
            r.set_fault([call](uint64_t handle) {
              py::gil_scoped_acquire gil;
              try {
                return (*call)(handle).cast<at::Tensor>();
              } catch (py::error_already_set& e) {
                cumulus::fail_from(e);
              }
            });
          },
          py::arg("fault"),
          "A record named a storage set aside: fault(handle) returns its bytes (flat uint8) "
          "or raises ReplayError(message, -1, kind).")
      .def_property_readonly("quota_bytes", &Replayer::quota_bytes)
      .def_property_readonly("ops_run", &Replayer::ops_run)
      .def("handles", &Replayer::handles, "The live storage handles, sorted.")
      .def("coldest", &Replayer::coldest,
           "The live storage handles, those no batch named for longest first.")
      .def("storage_view", &Replayer::storage_view, py::arg("handle"),
           "A storage's bytes as a flat uint8 tensor sharing its memory.");
}
