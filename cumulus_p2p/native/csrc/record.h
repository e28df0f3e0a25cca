// The wire record: what the client device appends to the batch for each op.
//
// Theory of operation
// -------------------
// A tensor on the native `cumulus` device owns no host memory. Its storage's data
// pointer *is* a remote storage handle (a 64-bit id from a counter, never dereferenced).
// Metadata and view kernels run locally; every other op is appended to one in-memory
// batch as a compact binary record, which a later slice ships to the executor and
// replays there through the c10 dispatcher. Python touches the batch once per flush,
// never once per op.
//
// Format (all integers little-endian, no padding):
//
//   Batch   := Record*
//   Record  := kind:u8 body_len:u32 body[body_len]     (body_len lets a reader skip kinds
//                                                      it does not know)
//   kind 1 OP       op:u32 nargs:u16 Value[nargs] nouts:u16 Value[nouts]
//                   `op` indexes the name table ("aten::add.Tensor", see intern()).
//                   Args are the schema's arguments in order, defaults included;
//                   outputs are what the op returned, their handles chosen by the client.
//   kind 2 ALLOC    handle:u64 nbytes:u64       an empty storage a later op fills in place
//   kind 3 UPLOAD   dst:Value(TENSOR) src:Value(HOST_TENSOR)     host -> device copy_
//   kind 4 READBACK src:Value(TENSOR)           the client waits for these bytes
//   kind 5 FREE     handle:u64                  the last client reference died
//   kind 6 RESIZE   handle:u64 nbytes:u64       the storage grows, keeping its contents
//   kind 7 DYN      op:u32 nargs:u16 Value[nargs] nouts:u16 handle:u64[nouts]
//                   an op whose outputs only running it can shape (unique, nonzero,
//                   masked_select, histogram...): the executor runs it, binds each tensor
//                   result to its handle (0 for a non-tensor return) in a contiguous
//                   storage of its own, and answers with a readback of Result[nouts];
//                   the client waits for it.
//
//   kind 8 SEED     seed:u64                    the session's generator starts over from
//                                               seed (torch.manual_seed)
//   kind 9 RNG_GET  (empty)                     the client waits for the generator's state
//                                               (its get_state() bytes)
//   kind 10 RNG_SET nbytes:u32 state[nbytes]    the generator takes a state RNG_GET read
//
//   kind 11 GRAPH   graph:u32 nbytes:u32 definition[nbytes]
//                   a graph torch.compile captured, once per session before its first
//                   RUN: the definition host/graphs.py validates, as msgpack bytes
//                   (wire/graph_def.py). The executor's Python keeps it under `graph`.
//   kind 12 RUN     graph:u32 nargs:u16 Value[nargs] nouts:u16 Value[nouts]
//                   one call of a defined graph: its inputs (tensor references or NONE),
//                   and a TENSOR with a new handle for each output the client needs (NONE
//                   for the others); the executor binds the graph's results to them as it
//                   binds an op's.
//
//   Result := 0 NONE | 1 TENSOR dtype:u8 ndim:u8 sizes:i64[ndim] strides:i64[ndim]
//             offset:i64 | 3 INT i64 | 4 DOUBLE f64 | 5 BOOL u8
//   A fresh result is contiguous at offset 0; an out= argument is described as the op
//   left it (linear algebra lays its outputs out column-major).
//
//   Value := tag:u8 payload
//     0 NONE
//     1 TENSOR      handle:u64 offset:i64 dtype:u8 ndim:u8 sizes:i64[ndim] strides:i64[ndim]
//     2 HOST_TENSOR dtype:u8 ndim:u8 sizes:i64[ndim] nbytes:u64 bytes   (contiguous)
//     3 INT i64     4 DOUBLE f64     5 BOOL u8     6 COMPLEX f64 f64
//     7 STRING len:u32 utf8
//     8 LIST  n:u32 Value[n]          (tensor lists, optional-tensor lists, mixed)
//     9 INTS  n:u32 i64[n]            (int lists: sizes, dims; the common case)
//    10 DEVICE type:i8 index:i8
//    11 GENERATOR                     (the session's generator on the executor)
//    12 TENSOR_BITS bits:u8 then TENSOR's payload: a lazily conjugated (bit 1) or
//                   negated (bit 2) view, as torch's conj() and neg views are; the
//                   executor applies the bits to its view (an upload's bytes are
//                   resolved on the client, a readback's on the executor)
//    13 NUMBER      HOST_TENSOR's payload: a Python number torch wrapped as a 0-dim
//                   tensor, which type promotion treats as a scalar (int tensor * 2.5
//                   is float32, where a float64 0-dim tensor would make it float64)
//
//   `dtype` is c10::ScalarType's numbering; `offset`, `sizes` and `strides` count
//   elements. Offsets and strides name a view of the storage, so the executor can cache
//   one view per distinct reference.
//
//   No record grows with a tensor: an upload or a readback of more than kPieceBytes
//   goes as one record per piece of a flat view (the batch is flushed between pieces
//   once it holds the flush hook's bytes), so frames and replies stay bounded.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace cumulus {

// The device type torch gives an out-of-tree backend: the cumulus device's.
constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;

// The most bytes of tensor data one UPLOAD or READBACK record carries.
constexpr int64_t kPieceBytes = 16 << 20;

// Calls f(a_piece, b_piece) for each piece of at most kPieceBytes of `a`, the same
// elements of `b`: two flat tensors of one length (an upload's or a readback's).
template <typename F>
void for_each_piece(const at::Tensor& a, const at::Tensor& b, F&& f) {
  const int64_t step = std::max<int64_t>(1, kPieceBytes / a.element_size());
  for (int64_t at = 0; at < a.numel(); at += step) {
    const int64_t n = std::min(step, a.numel() - at);
    f(a.narrow(0, at, n), b.narrow(0, at, n));
  }
}

enum class Kind : uint8_t {
  Op = 1,
  Alloc = 2,
  Upload = 3,
  Readback = 4,
  Free = 5,
  Resize = 6,
  Dyn = 7,
  Seed = 8,
  RngGet = 9,
  RngSet = 10,
  Graph = 11,
  Run = 12,
};

enum class Tag : uint8_t {
  None = 0,
  Tensor = 1,
  HostTensor = 2,
  Int = 3,
  Double = 4,
  Bool = 5,
  Complex = 6,
  String = 7,
  List = 8,
  Ints = 9,
  Device = 10,
  Generator = 11,
  TensorBits = 12,
  Number = 13,
};

// TENSOR_BITS flags.
constexpr uint8_t kConjBit = 1;
constexpr uint8_t kNegBit = 2;

// Appends fixed-width little-endian fields (x86-64 and aarch64 are little-endian, so a
// memcpy is the encoding).
class Writer {
 public:
  template <typename T>
  void put(T value) {
    const size_t at = buf_.size();
    buf_.resize(at + sizeof(T));
    std::memcpy(&buf_[at], &value, sizeof(T));
  }
  void bytes(const void* data, size_t n) {
    buf_.append(static_cast<const char*>(data), n);
  }
  // Starts a record; `end_record` writes its length once the body is known.
  void begin_record(Kind kind) {
    put<uint8_t>(static_cast<uint8_t>(kind));
    len_at_ = buf_.size();
    put<uint32_t>(0);
  }
  void end_record() {
    const uint32_t len = static_cast<uint32_t>(buf_.size() - len_at_ - sizeof(uint32_t));
    std::memcpy(&buf_[len_at_], &len, sizeof(len));
  }
  void clear() { buf_.clear(); }
  const std::string& data() const { return buf_; }

 private:
  std::string buf_;
  size_t len_at_ = 0;
};

// Appends an int, a double or a bool as its tagged value and returns true; returns false,
// appending nothing, for any other value. Op arguments (record.cpp) and the results a DYN
// record answers with (replay.cpp) write these three alike.
inline bool put_plain_scalar(Writer& w, const c10::IValue& v) {
  if (v.isInt()) {
    w.put<uint8_t>(static_cast<uint8_t>(Tag::Int));
    w.put<int64_t>(v.toInt());
  } else if (v.isDouble()) {
    w.put<uint8_t>(static_cast<uint8_t>(Tag::Double));
    w.put<double>(v.toDouble());
  } else if (v.isBool()) {
    w.put<uint8_t>(static_cast<uint8_t>(Tag::Bool));
    w.put<uint8_t>(v.toBool());
  } else {
    return false;
  }
  return true;
}

// The handle a device storage's data pointer encodes.
uint64_t handle_of(const c10::Storage& storage);

// Value encoders (record.cpp).
void put_tensor_ref(Writer& w, const at::Tensor& t);
void put_value(Writer& w, const c10::IValue& v);

// The session's batch: records appended by any thread (autograd's device thread
// included), taken whole by Python at a flush.
void append_record(const Writer& w);
void append_alloc(uint64_t handle, uint64_t nbytes);
void append_free(uint64_t handle);
void append_resize(uint64_t handle, uint64_t nbytes);
void append_seed(uint64_t seed);
// The executor's generator state, read (a sync point) or set in order with the ops
// around it (torch.cumulus.get_rng_state / set_rng_state, fork_rng).
std::string rng_state();
void append_rng_state(const std::string& state);
// A compiled graph (graphs.cpp): its definition, sent once per session, and one call,
// whose outputs are new storages laid out as `layouts` (meta tensors; None: an output
// the client needs no storage for) say.
void append_graph(uint32_t graph, const std::string& definition);
std::vector<std::optional<at::Tensor>> run_graph(
    uint32_t graph, const std::vector<std::optional<at::Tensor>>& inputs,
    const std::vector<std::optional<at::Tensor>>& layouts);
std::pair<std::string, uint64_t> take_batch();
uint64_t pending_records();
// Op records (OP, DYN and RUN) appended since the process started: what a benchmark counts
// as the ops a step sent.
uint64_t ops_recorded();

// A new session starts: the pending batch is dropped, and storages created before now
// (whose executor is gone) append no FREE when they die. Returns the first handle the
// new session's storages get.
uint64_t begin_session();

// The allocator the kernels use (device.cpp): it records nothing, where the one torch
// gets for the device records an ALLOC for each storage it makes.
c10::Allocator* kernel_allocator();

// The bytes of this session's live storages (device.cpp): a storage that grows says so
// through set_storage_bytes, which sets its size.
void set_storage_bytes(c10::StorageImpl* storage, size_t nbytes);
uint64_t bytes_allocated();
uint64_t peak_bytes_allocated();
void reset_peak_bytes();  // the peak starts over from the live bytes
// How far the live bytes peaked above those when the last batch was taken, since then;
// starts over from the live bytes.
uint64_t take_growth();

// The operator name table: a record carries an op's index, not its name.
uint32_t intern(const c10::OperatorHandle& op);
uint32_t intern_name(const std::string& name);
std::vector<std::string> op_names();

// Sends the batch early, while the client goes on recording, so that the executor
// replays one part of a step while the client records the next (set from Python).
// `maybe_flush` calls the hook when the batch holds at least `nbytes`; the fallback
// calls it after each op record, never a storage's deleter.
using FlushHook = std::function<void()>;
void set_flush_hook(FlushHook hook, uint64_t nbytes);
void maybe_flush();

// Fills a host tensor with a device tensor's bytes: the session's sync point, set from
// Python. Unset, reading back raises (no executor is attached in this slice).
using ReadbackHook = std::function<void(const at::Tensor& src, const at::Tensor& dst)>;
void set_readback_hook(ReadbackHook hook);
void read_back(const at::Tensor& src, const at::Tensor& dst);

// Sends the batch and waits for its last readback's bytes (a DYN record's results):
// the session's other sync point, set from Python.
using SyncHook = std::function<std::string()>;
void set_sync_hook(SyncHook hook);
std::string sync();

// Runs `op` on the executor now (a DYN record and a sync) and returns its results, for a
// question only the executor's device can answer (kernels.cpp).
std::vector<c10::IValue> run_on_executor(const c10::OperatorHandle& op,
                                         std::vector<c10::IValue> args);

// The executor's device type, from the session's welcome (device.cpp): "cpu", "cuda"...,
// "" when none is attached. Ops whose kernel depends on the device take the one it would
// (attention.cpp: the fused attention it picks; dropout.cpp: its dropout).
enum class Executor : int { Unknown, Cpu, Gpu };
void set_executor_device(const std::string& type);
Executor executor_device();
void forget_attention_choices();  // attention.cpp: the last executor's answers

}  // namespace cumulus
