// torch's own profiler (Kineto: aten ops on the CPU, CUDA kernels and copies through CUPTI)
// around one step of this worker, and named ranges for its phases, which tch does not bind.
// Driven by worker/src/profile.rs (`MT_TORCH_PROFILE`); compiled by worker/build.rs against
// the libtorch the worker links.

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstring>
#include <exception>
#include <memory>
#include <set>
#include <string>

namespace {
namespace prof = torch::profiler::impl;

char* error_text(const std::exception& e) { return strdup(e.what()); }
}  // namespace

// Starts collecting aten ops (with input shapes) and, with `cuda`, kernels and copies.
// Returns null, or the error's text (malloc'd: the caller frees it).
extern "C" char* mt_profile_start(int cuda) {
  try {
    prof::ProfilerConfig config(prof::ProfilerState::KINETO, /*report_input_shapes=*/true);
    std::set<prof::ActivityType> activities{prof::ActivityType::CPU};
    if (cuda) activities.insert(prof::ActivityType::CUDA);
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
    return nullptr;
  } catch (const std::exception& e) {
    return error_text(e);
  }
}

// Stops it and writes what it saw to `path` as a Chrome trace (JSON).
extern "C" char* mt_profile_stop(const char* path) {
  try {
    auto result = torch::autograd::profiler::disableProfiler();
    result->save(path);
    return nullptr;
  } catch (const std::exception& e) {
    return error_text(e);
  }
}

// A named range on this thread (a user annotation in the trace), open until
// `mt_profile_range_end` gets the handle back.
extern "C" void* mt_profile_range_begin(const char* name) {
  auto* rf = new at::RecordFunction(at::RecordScope::USER_SCOPE);
  if (rf->isActive()) rf->before(name);
  return rf;
}

extern "C" void mt_profile_range_end(void* handle) {
  delete static_cast<at::RecordFunction*>(handle);  // its destructor ends the range
}
