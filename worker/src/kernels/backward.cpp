// Autograd's backward from given gradients (torch::autograd::backward(outputs, grads)),
// which tch 0.24 does not bind: the kernels' tape (worker/src/kernels/tape.rs) hands a fused
// op's input gradients to the graphs that made its inputs with it, and a layer's backward
// starts from its output's gradient, instead of backpropagating a scalar
// sum(output * grad) (a product, a sum, and in the backward a cast of the sum's gradient and
// a product: four passes over the output for nothing).
// Compiled by worker/build.rs against the libtorch the worker links.

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>

#include <cstring>
#include <exception>
#include <string>
#include <vector>

// `outputs[i]` receives gradient `grads[i]` (tch's tensors are at::Tensor pointers). Each
// output is released (reset to an undefined tensor) once its place in the graph is taken,
// before the pass runs: the pass needs the output's graph node, not its memory, which so
// is free for the backward unless something else holds it. Each gradient is handed over
// (moved, leaving the caller's handle undefined): a leaf's accumulator then takes it as
// the leaf's gradient instead of copying it, unless something else holds it. Returns
// null, or the error's text (malloc'd: the caller frees it).
extern "C" char* mt_backward_with_grads(at::Tensor* const* outputs, at::Tensor* const* grads,
                                        int n) {
  try {
    torch::autograd::edge_list roots;
    torch::autograd::variable_list g;
    roots.reserve(n);
    g.reserve(n);
    for (int i = 0; i < n; i++) {
      at::Tensor& out = *outputs[i];
      TORCH_CHECK(out.requires_grad(), "output ", i, " of the backward does not require grad");
      TORCH_CHECK(out.sizes() == grads[i]->sizes(), "output ", i, " is ", out.sizes(),
                  " but its gradient is ", grads[i]->sizes());
      roots.push_back(torch::autograd::impl::gradient_edge(out));
      g.push_back(std::move(*grads[i]));
      out = at::Tensor();
    }
    torch::autograd::Engine::get_default_engine().execute(roots, g, /*keep_graph=*/false,
                                                           /*create_graph=*/false,
                                                           /*accumulate_grad=*/true);
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
