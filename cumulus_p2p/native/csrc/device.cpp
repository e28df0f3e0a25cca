// The `cumulus` device's runtime pieces: an allocator of remote storage handles, a
// device guard and PrivateUse1 hooks. There is one device, cumulus:0 (a session's
// executor), and one stream on it: ordering is the batch's order.
#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "record.h"

namespace cumulus {
namespace {

// A storage's "pointer" is its handle on the executor. Nothing on the client may
// dereference it; handles start at 1 so that a storage never looks unallocated.
std::atomic<uint64_t> next_handle{1};

// Handles below the floor belong to an earlier session (or to none): their executor is
// gone, so their deaths append nothing to this session's batch.
std::atomic<uint64_t> session_floor{1};

// The bytes of this session's live storages, as torch.cuda.memory_allocated counts a
// GPU's: each handle's size, kept as its storage grows, and the peak since a reset. The
// peak since the last batch was taken says how far the next one grows the executor's.
struct Bytes {
  std::mutex mutex;
  std::unordered_map<uint64_t, uint64_t> of_handle;
  uint64_t live = 0;
  uint64_t peak = 0;
  uint64_t batch_base = 0;
  uint64_t batch_peak = 0;

  void set(uint64_t handle, uint64_t nbytes) {
    std::lock_guard<std::mutex> lock(mutex);
    uint64_t& size = of_handle[handle];
    live = live - size + nbytes;
    size = nbytes;
    peak = std::max(peak, live);
    batch_peak = std::max(batch_peak, live);
  }

  void forget(uint64_t handle) {
    std::lock_guard<std::mutex> lock(mutex);
    auto found = of_handle.find(handle);
    if (found == of_handle.end()) return;
    live -= found->second;
    of_handle.erase(found);
  }
};
Bytes& bytes() {
  static auto* b = new Bytes();  // never destroyed: storages may die at exit
  return *b;
}

bool of_this_session(uint64_t handle) {
  return handle >= session_floor.load(std::memory_order_relaxed);
}

void free_handle(void* ctx) {
  const auto handle = reinterpret_cast<uint64_t>(ctx);
  if (!of_this_session(handle)) return;
  bytes().forget(handle);
  append_free(handle);
}

// The kernels' allocator: a fresh handle, and nothing recorded. The kernels record an
// ALLOC themselves (empty), or the executor binds an op's output to the handle.
struct HandleAllocator : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const uint64_t handle = next_handle.fetch_add(1);
    bytes().set(handle, nbytes);
    void* ptr = reinterpret_cast<void*>(handle);
    return {ptr, ptr, &free_handle, c10::Device(kType, 0)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_handle; }
  void copy_data(void* /*dest*/, const void* /*src*/, std::size_t /*count*/) const override {
    TORCH_CHECK(false, "cumulus: storages live on the executor; copy tensors, not storages");
  }
};

// The allocator torch itself gets for the device. A storage it makes outside any
// kernel (`UntypedStorage(n, device="cumulus")`, as torch.load restores one) must exist
// on the executor before bytes are copied into it: an ALLOC.
struct RecordingAllocator final : HandleAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DataPtr ptr = HandleAllocator::allocate(nbytes);
    append_alloc(reinterpret_cast<uint64_t>(ptr.get()), nbytes);
    return ptr;
  }
};

HandleAllocator quiet;
RecordingAllocator recording;
REGISTER_ALLOCATOR(kType, &recording);

struct Guard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device /*d*/) const override { return {kType, 0}; }
  c10::Device getDevice() const override { return {kType, 0}; }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.index() <= 0, "cumulus: a session exposes one device, cumulus:0");
  }
  void uncheckedSetDevice(c10::Device /*d*/) const noexcept override {}
  c10::Stream getStream(c10::Device d) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  // Events: the batch is one ordered stream, so there is nothing to wait for
  // between streams; the base class's defaults do nothing.
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex /*device_index*/) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  // Tensors on the device have no host bytes, so nothing is ever pinned for it.
  bool isPinnedPtr(const void* /*data*/) const override { return false; }
  // Pinning speeds DMA to a local device; the bytes of this one cross a network, so a
  // host tensor asked to be pinned is an ordinary one.
  at::Allocator* getPinnedMemoryAllocator() const override { return c10::GetAllocator(c10::DeviceType::CPU); }
  at::Device getDeviceFromPtr(void* /*data*/) const override { return {kType, 0}; }
};

// Hooks are registered at load, as the guard and allocator are; torch asks for them
// when it first initialises the device (autograd's engine does, for instance).
const bool hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

}  // namespace

c10::Allocator* kernel_allocator() { return &quiet; }

namespace {
std::atomic<Executor> executor{Executor::Unknown};
}  // namespace

void set_executor_device(const std::string& type) {
  forget_attention_choices();  // a new executor may have another device
  executor = type.empty() ? Executor::Unknown : type == "cpu" ? Executor::Cpu : Executor::Gpu;
}

Executor executor_device() { return executor.load(std::memory_order_relaxed); }

uint64_t begin_session() {
  session_floor.store(next_handle.load());
  take_batch();  // records for no executor, or for the last one
  {
    Bytes& b = bytes();
    std::lock_guard<std::mutex> lock(b.mutex);
    b.of_handle.clear();
    b.live = b.peak = b.batch_base = b.batch_peak = 0;
  }
  return session_floor.load();
}

void set_storage_bytes(c10::StorageImpl* storage, size_t nbytes) {
  storage->set_nbytes(nbytes);
  const auto handle = reinterpret_cast<uint64_t>(storage->data_ptr().get());
  if (of_this_session(handle)) bytes().set(handle, nbytes);
}

uint64_t bytes_allocated() {
  Bytes& b = bytes();
  std::lock_guard<std::mutex> lock(b.mutex);
  return b.live;
}

uint64_t peak_bytes_allocated() {
  Bytes& b = bytes();
  std::lock_guard<std::mutex> lock(b.mutex);
  return b.peak;
}

uint64_t take_growth() {
  Bytes& b = bytes();
  std::lock_guard<std::mutex> lock(b.mutex);
  const uint64_t grown = b.batch_peak - b.batch_base;
  b.batch_base = b.batch_peak = b.live;
  return grown;
}

void reset_peak_bytes() {
  Bytes& b = bytes();
  std::lock_guard<std::mutex> lock(b.mutex);
  b.peak = b.live;
}

}  // namespace cumulus
