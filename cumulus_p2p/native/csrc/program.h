// A compiled graph run by the replay loop in C++ (replay.cpp's RUN records).
//
// host/graphs.py validates a graph's definition and prepares it (`GraphProgram`): each
// node's op resolved, its arguments as templates that hold constants and references to
// a graph input or an earlier node's result, and which results each node reads last.
// Run in Python, each node costs an interpreter's call (about 14 µs on this project's
// CPUs) where the replay loop calls an op in about 3. So a native session's programs
// come here once (`Program::from_python`, with the GIL): every argument is turned into
// an IValue of its schema type, or a reference, once; and each call (`run`) is a loop of
// boxed calls through the dispatcher, without Python, as an eager batch's ops are.
// Intermediates are dropped after their last use, and those alive at once are counted
// against the budget the caller gives (the session's free quota), as graphs.py does.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <vector>

namespace cumulus {

// A graph that cannot run: `kind` is a ReplayError kind (invalid_graph, op_failed,
// out_of_memory), `message` says why, naming the node.
struct ProgramError {
  std::string kind;
  std::string message;
};

class Program {
 public:
  // `nodes`: per node (op name "aten::add", overload, slots, fresh, release), a slot per
  // schema argument: (0, value) a constant, (1, is_input, index, item) a reference,
  // (2, [slots]) a list holding references, (3,) the argument's default. `outputs`: per
  // output None or a reference's (is_input, index, item). Throws ProgramError.
  static Program from_python(const py::list& nodes, const py::list& outputs, int64_t n_inputs,
                             int64_t factory_bytes);

  // The graph's outputs for `inputs`, its live intermediates within `budget` bytes.
  // Throws ProgramError naming the node that failed.
  std::vector<std::optional<at::Tensor>> run(const std::vector<at::Tensor>& inputs,
                                             int64_t budget, uint32_t graph) const;

  struct Slot {
    enum class Kind : uint8_t { Const, Ref, List } kind = Kind::Const;
    c10::IValue constant;
    bool input = false;
    int64_t index = 0, item = -1;
    std::vector<Slot> items;
    c10::TypePtr element;  // a List's element type, as the schema names it
  };
  struct Node {
    c10::OperatorHandle op;
    std::string name;
    std::vector<Slot> args;
    bool fresh;
    std::vector<int64_t> release;
  };

 private:
  Program() = default;
  std::vector<Node> nodes_;
  std::vector<std::optional<Slot>> outputs_;
  int64_t n_inputs_ = 0;
  int64_t factory_bytes_ = 0;
};

}  // namespace cumulus
