// What Python sees of the native device: the batch, the op name table and the
// readback hook. Everything here runs once per flush or per session, never per op.
// pybind11 with torch's type casters, not <torch/extension.h>, whose C++ frontend (nn,
// optim, data) nothing here uses and which tripled the compile time.
#include <torch/csrc/utils/pybind.h>

#include "record.h"

namespace {

py::tuple take_batch() {
  auto [data, records] = cumulus::take_batch();
  return py::make_tuple(py::bytes(data), records);
}

uint64_t handle(const at::Tensor& t) {
  TORCH_CHECK(t.is_privateuseone(), "cumulus: not a tensor on the cumulus device");
  return cumulus::handle_of(t.storage());
}

// The hook runs on whichever thread reads back (autograd's device thread included),
// so it takes the GIL itself; the callable lives as long as the process.
void set_readback_hook(py::object fn) {
  if (fn.is_none()) {
    cumulus::set_readback_hook(nullptr);
    return;
  }
  auto* kept = new py::object(std::move(fn));
  cumulus::set_readback_hook([kept](const at::Tensor& src, const at::Tensor& dst) {
    py::gil_scoped_acquire gil;
    (*kept)(src, dst);
  });
}

// As the readback hook: any recording thread may call it, so it takes the GIL.
void set_flush_hook(py::object fn, uint64_t nbytes) {
  if (fn.is_none()) {
    cumulus::set_flush_hook(nullptr, 0);
    return;
  }
  auto* kept = new py::object(std::move(fn));
  cumulus::set_flush_hook(
      [kept]() {
        py::gil_scoped_acquire gil;
        (*kept)();
      },
      nbytes);
}

// As the readback hook; fn() returns the bytes of the batch's last readback.
void set_sync_hook(py::object fn) {
  if (fn.is_none()) {
    cumulus::set_sync_hook(nullptr);
    return;
  }
  auto* kept = new py::object(std::move(fn));
  cumulus::set_sync_hook([kept]() {
    py::gil_scoped_acquire gil;
    return (*kept)().cast<std::string>();
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The native cumulus device: records ops into a batch of wire records.";
  m.def("take_batch", &take_batch,
        "Take the pending records: (bytes, record count); the batch starts empty again.");
  m.def("begin_session", &cumulus::begin_session,
        "Drop the pending batch; storages made before now free nothing. The first new handle.");
  m.def("pending_records", &cumulus::pending_records, "Records waiting in the batch.");
  m.def("ops_recorded", &cumulus::ops_recorded, "Op records appended since the process started.");
  m.def("seed", &cumulus::append_seed, "Append a SEED: the executor's generator starts over.");
  m.def(
      "rng_state", [] { return py::bytes(cumulus::rng_state()); },
      "The executor generator's state (a sync point: the batch goes, its answer comes).");
  m.def(
      "set_rng_state", [](const py::bytes& state) { cumulus::append_rng_state(state); },
      "Append an RNG_SET: the executor's generator takes a state rng_state read.");
  m.def("intern", &cumulus::intern_name, "The name table index of an op name.");
  m.def(
      "op_names",
      [](size_t start) {
        std::vector<std::string> names = cumulus::op_names();
        names.erase(names.begin(), names.begin() + std::min(start, names.size()));
        return names;
      },
      py::arg("start") = 0,
      "The name table from index `start`: records carry indexes into it.");
  m.def(
      "define_graph",
      [](uint32_t graph, const py::bytes& definition) { cumulus::append_graph(graph, definition); },
      py::arg("graph"), py::arg("definition"),
      "Append a GRAPH: a compiled graph's definition (msgpack bytes), under id `graph`.");
  m.def("run_graph", &cumulus::run_graph, py::arg("graph"), py::arg("inputs"), py::arg("layouts"),
        "Append a RUN of graph `graph` on `inputs`; its outputs, new device tensors laid out "
        "as the meta tensors `layouts` (None where no storage is needed).");
  m.def("handle", &handle, "The remote storage handle behind a cumulus tensor.");
  m.def("memory_allocated", &cumulus::bytes_allocated,
        "Bytes of this session's live storages, as a GPU's memory_allocated counts.");
  m.def("max_memory_allocated", &cumulus::peak_bytes_allocated,
        "The most memory_allocated has been since the session began or the last reset.");
  m.def("reset_peak_memory_stats", &cumulus::reset_peak_bytes,
        "Start max_memory_allocated over from the bytes live now.");
  m.def("take_growth", &cumulus::take_growth,
        "The bytes the pending records' storages grow the session by at most (their peak "
        "over the live bytes when the last batch was taken); starts over.");
  m.def("set_executor_device", &cumulus::set_executor_device,
        "The executor's device type ('cpu', 'cuda'...; '' for none), whose kernels "
        "attention and dropout take.");
  m.def("set_flush_hook", &set_flush_hook, py::arg("fn"), py::arg("nbytes") = 0,
        "fn() sends the batch once it holds nbytes, after an op record; None unsets.");
  m.def("set_sync_hook", &set_sync_hook,
        "fn() sends the batch and returns its last readback's bytes; None unsets.");
  m.def("set_readback_hook", &set_readback_hook,
        "fn(src, dst) fills host tensor dst with device tensor src's bytes; None unsets.");
}
