// Compiled graphs on the client (record.h, GRAPH and RUN): the definition goes once per
// session, and each call is one record, whatever the graph's depth. The outputs are new
// storages shaped as the capture said, as an op's outputs are shaped by its meta kernel;
// the executor binds the graph's results to their handles.
#include "record.h"

namespace cumulus {

void append_graph(uint32_t graph, const std::string& definition) {
  TORCH_CHECK(definition.size() <= UINT32_MAX, "cumulus: a graph definition over 4 GiB");
  Writer w;
  w.begin_record(Kind::Graph);
  w.put<uint32_t>(graph);
  w.put<uint32_t>(static_cast<uint32_t>(definition.size()));
  w.bytes(definition.data(), definition.size());
  w.end_record();
  append_record(w);
}

namespace {

// A device tensor over a new storage (no ALLOC: the executor binds a result to it).
at::Tensor fresh_like(const at::Tensor& layout) {
  const size_t nbytes = layout.storage().nbytes();
  c10::Allocator* allocator = kernel_allocator();
  c10::Storage storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, allocator->allocate(nbytes), allocator,
      /*resizable=*/true));
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), layout.dtype());
  impl->set_sizes_and_strides(layout.sizes(), layout.strides(), layout.storage_offset());
  return at::Tensor(std::move(impl));
}

}  // namespace

std::vector<std::optional<at::Tensor>> run_graph(
    uint32_t graph, const std::vector<std::optional<at::Tensor>>& inputs,
    const std::vector<std::optional<at::Tensor>>& layouts) {
  TORCH_CHECK(inputs.size() <= UINT16_MAX && layouts.size() <= UINT16_MAX,
              "cumulus: a graph call has at most 65535 inputs and outputs");
  std::vector<std::optional<at::Tensor>> outputs;
  outputs.reserve(layouts.size());
  for (const auto& layout : layouts) {
    outputs.push_back(layout ? std::optional<at::Tensor>(fresh_like(*layout)) : std::nullopt);
  }
  Writer w;
  w.begin_record(Kind::Run);
  w.put<uint32_t>(graph);
  w.put<uint16_t>(static_cast<uint16_t>(inputs.size()));
  for (const auto& t : inputs) put_tensor_ref(w, t.value_or(at::Tensor()));
  w.put<uint16_t>(static_cast<uint16_t>(outputs.size()));
  for (const auto& t : outputs) put_tensor_ref(w, t.value_or(at::Tensor()));
  w.end_record();
  append_record(w);
  maybe_flush();
  return outputs;
}

}  // namespace cumulus
