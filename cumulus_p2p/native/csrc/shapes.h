// Output shapes for the fallback, in C++.
//
// The fallback learns an op's outputs from a meta kernel. torch registers Python meta
// kernels (torch/_meta_registrations.py, torch/_refs) over the C++ ones for most
// aten ops, and a Python meta call costs 50-100 µs, twenty times a CPU dispatch. So
// the ops a training step runs most get their shapes here: structured ops through
// their C++ meta functions (`at::meta::add`, which the Python registration shadows
// but does not remove), and a few ops that have only a Python meta kernel through a
// short rule of our own. Every other op still reaches the dispatcher's Meta kernel.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <ATen/core/boxing/KernelFunction.h>
#include <ATen/core/stack.h>

namespace cumulus {

// How to run an op on meta tensors without Python: a C++ meta kernel, or a rule that
// pops the (meta) arguments from the stack and pushes meta outputs.
struct ShapeFn {
  std::optional<c10::KernelFunction> kernel;
  void (*rule)(torch::jit::Stack*) = nullptr;
  // An op that writes its arguments in place and returns nothing (a foreach op,
  // kernels.cpp) has nothing to shape.
  bool nothing = false;
  bool known() const { return kernel.has_value() || rule != nullptr || nothing; }
};

ShapeFn find_shape_fn(const std::string& op_name);

// The boxed fallback (kernels.cpp), registered directly for the ops above so that
// functional ops skip torch's composite "allocate, then call the out= variant"
// kernels and stay one record each.
void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);

}  // namespace cumulus
