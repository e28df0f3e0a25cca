// A compiled graph run by the replay loop in C++: see program.h.
#include "program.h"

#include <torch/csrc/jit/python/pybind_utils.h>

namespace cumulus {
namespace {

[[noreturn]] void refuse(const std::string& message) { throw ProgramError{"invalid_graph", message}; }

c10::TypePtr unwrapped(const c10::TypePtr& type) {
  if (auto optional = type->cast<c10::OptionalType>()) return optional->getElementType();
  return type;
}

Program::Slot reference(const py::tuple& spec, size_t at) {
  Program::Slot slot;
  slot.kind = Program::Slot::Kind::Ref;
  slot.input = spec[at].cast<bool>();
  slot.index = spec[at + 1].cast<int64_t>();
  slot.item = spec[at + 2].cast<int64_t>();
  return slot;
}

// One argument's template as its schema type wants it (see program.h for the specs).
Program::Slot slot_of(const py::handle& handle, const c10::Argument& argument,
                      const c10::TypePtr& type) {
  const auto spec = py::reinterpret_borrow<py::tuple>(handle);
  const int tag = spec[0].cast<int>();
  Program::Slot slot;
  switch (tag) {
    case 0:
      try {
        slot.constant = torch::jit::toIValue(spec[1], type);
      } catch (const std::exception& e) {
        refuse("argument " + argument.name() + " is not a " + type->str() + ": " + e.what());
      }
      return slot;
    case 1:
      return reference(spec, 1);
    case 2: {
      const auto list = unwrapped(type)->cast<c10::ListType>();
      if (!list) refuse("argument " + argument.name() + " is a list where the schema wants " + type->str());
      slot.kind = Program::Slot::Kind::List;
      slot.element = list->getElementType();
      for (const auto& item : spec[1].cast<py::list>()) {
        slot.items.push_back(slot_of(item, argument, slot.element));
      }
      return slot;
    }
    case 3:
      if (!argument.default_value()) refuse("argument " + argument.name() + " has no default");
      slot.constant = *argument.default_value();
      return slot;
  }
  refuse("unknown slot tag " + std::to_string(tag));
}

int64_t tensor_bytes(const c10::IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    return t.defined() ? static_cast<int64_t>(t.numel() * t.element_size()) : 0;
  }
  if (v.isTensorList()) {
    int64_t n = 0;
    for (const at::Tensor& t : v.toTensorList()) n += tensor_bytes(t);
    return n;
  }
  return 0;
}

}  // namespace

Program Program::from_python(const py::list& nodes, const py::list& outputs, int64_t n_inputs,
                             int64_t factory_bytes) {
  Program p;
  p.n_inputs_ = n_inputs;
  p.factory_bytes_ = factory_bytes;
  for (const auto& handle : nodes) {
    const auto spec = handle.cast<py::tuple>();
    const auto name = spec[0].cast<std::string>();
    const auto overload = spec[1].cast<std::string>();
    const auto op = c10::Dispatcher::singleton().findSchema({name, overload});
    if (!op) refuse("no op named " + name + "." + overload);
    const auto slots = spec[2].cast<py::list>();
    const auto& arguments = op->schema().arguments();
    if (slots.size() != arguments.size()) refuse(name + ": one slot per argument");
    Node node{*op, overload.empty() ? name : name + "." + overload, {},
              spec[3].cast<bool>(), spec[4].cast<std::vector<int64_t>>()};
    for (size_t i = 0; i < arguments.size(); ++i) {
      node.args.push_back(slot_of(slots[i], arguments[i], arguments[i].type()));
    }
    p.nodes_.push_back(std::move(node));
  }
  for (const auto& handle : outputs) {
    if (handle.is_none()) {
      p.outputs_.emplace_back();
    } else {
      p.outputs_.emplace_back(reference(handle.cast<py::tuple>(), 0));
    }
  }
  return p;
}

namespace {

using Results = std::vector<torch::jit::Stack>;

c10::IValue lookup(const Program::Slot& ref, const std::vector<at::Tensor>& inputs,
                   const Results& results) {
  if (ref.input) {
    if (ref.item >= 0) refuse("an input has no elements");
    return inputs.at(static_cast<size_t>(ref.index));
  }
  const torch::jit::Stack& value = results.at(static_cast<size_t>(ref.index));
  if (value.empty()) refuse("value " + std::to_string(ref.index) + " was dropped before its use");
  if (ref.item < 0) return value.size() == 1 ? value[0] : c10::IValue(c10::ivalue::Tuple::create(value));
  const auto item = static_cast<size_t>(ref.item);
  if (value.size() > 1) {
    if (item >= value.size()) refuse("value " + std::to_string(ref.index) + " has no element " + std::to_string(item));
    return value[item];
  }
  if (!value[0].isList() || item >= value[0].toListRef().size()) {
    refuse("value " + std::to_string(ref.index) + " has no element " + std::to_string(item));
  }
  return value[0].toListRef()[item];
}

c10::IValue filled(const Program::Slot& slot, const std::vector<at::Tensor>& inputs,
                   const Results& results) {
  switch (slot.kind) {
    case Program::Slot::Kind::Const:
      return slot.constant;
    case Program::Slot::Kind::Ref:
      return lookup(slot, inputs, results);
    case Program::Slot::Kind::List: {
      c10::impl::GenericList list(slot.element);
      list.reserve(slot.items.size());
      for (const auto& item : slot.items) list.push_back(filled(item, inputs, results));
      return list;
    }
  }
  refuse("unknown slot");
}

}  // namespace

std::vector<std::optional<at::Tensor>> Program::run(const std::vector<at::Tensor>& inputs,
                                                    int64_t budget, uint32_t graph) const {
  const std::string of_graph = " of compiled graph " + std::to_string(graph);
  if (static_cast<int64_t>(inputs.size()) != n_inputs_) {
    refuse("the graph takes " + std::to_string(n_inputs_) + " inputs, not " +
           std::to_string(inputs.size()));
  }
  if (factory_bytes_ > budget) {
    throw ProgramError{"out_of_memory", "graph " + std::to_string(graph) + " allocates " +
                                            std::to_string(factory_bytes_) + " bytes; " +
                                            std::to_string(budget) + " are free"};
  }
  Results results(nodes_.size());
  std::vector<int64_t> held(nodes_.size(), 0);
  int64_t live = 0;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const Node& node = nodes_[i];
    const std::string where = node.name + " (node " + std::to_string(i) + of_graph + ")";
    torch::jit::Stack& stack = results[i];
    stack.reserve(node.args.size());
    for (const auto& arg : node.args) stack.push_back(filled(arg, inputs, results));
    try {
      node.op.callBoxed(&stack);
    } catch (const c10::OutOfMemoryError& e) {
      throw ProgramError{"out_of_memory", where + ": " + e.what_without_backtrace()};
    } catch (const c10::Error& e) {
      throw ProgramError{"op_failed", where + ": " + e.what_without_backtrace()};
    }
    if (node.fresh) {
      for (const auto& v : stack) held[i] += tensor_bytes(v);
      live += held[i];
      if (live > budget) {
        throw ProgramError{"out_of_memory", where + ": intermediate values of " +
                                                std::to_string(live) + " bytes exceed the free quota (" +
                                                std::to_string(budget) + ")"};
      }
    }
    for (const int64_t done : node.release) {
      results[static_cast<size_t>(done)].clear();
      live -= held[static_cast<size_t>(done)];
    }
  }
  std::vector<std::optional<at::Tensor>> out;
  out.reserve(outputs_.size());
  for (const auto& ref : outputs_) {
    if (!ref) {
      out.emplace_back();
      continue;
    }
    const c10::IValue v = lookup(*ref, inputs, results);
    if (!v.isTensor()) refuse("an output" + of_graph + " is not a tensor");
    out.emplace_back(v.toTensor());
  }
  return out;
}

}  // namespace cumulus
