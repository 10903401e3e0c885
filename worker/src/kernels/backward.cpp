// Autograd's backward from given gradients (torch::autograd::backward(outputs, grads)),
// which tch 0.24 does not bind: the kernels' tape (worker/src/kernels/tape.rs) hands a fused
// op's input gradients to the graphs that made its inputs with it, instead of
// backpropagating a scalar sum(input * grad) (two extra passes over every input).
// Compiled by worker/build.rs against the libtorch the worker links.

#include <torch/csrc/autograd/autograd.h>

#include <cstring>
#include <exception>
#include <vector>

// `outputs[i]` receives gradient `grads[i]` (tch's tensors are at::Tensor pointers). Returns
// null, or the error's text (malloc'd: the caller frees it).
extern "C" char* mt_backward_with_grads(const at::Tensor* const* outputs,
                                        const at::Tensor* const* grads, int n) {
  try {
    std::vector<at::Tensor> o, g;
    o.reserve(n);
    g.reserve(n);
    for (int i = 0; i < n; i++) {
      o.push_back(*outputs[i]);
      g.push_back(*grads[i]);
    }
    torch::autograd::backward(o, g);
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
