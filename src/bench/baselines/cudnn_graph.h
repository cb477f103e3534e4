// Shared by the cuDNN baselines: libcudnn loaded at run time, one handle per device, graphs
// built once and cached, and the Implementation that executes one. Only for the sources CMake
// compiles with the cuDNN frontend (src/bench/CMakeLists.txt).
#pragma once

#if !(TRAINSCALE_HAVE_CUDA && TRAINSCALE_HAVE_CUDNN_FRONTEND)
#error "bench/baselines/cudnn_graph.h needs the cuDNN frontend headers (see src/bench/CMakeLists.txt)"
#endif

// The frontend resolves every cuDNN call through cudnn_frontend::cudnn_dlhandle (set once
// libcudnn is loaded, cudnn_graph.cc), so nothing links against libcudnn.
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING 1

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

// Third-party headers (found through -isystem; the pragmas cover compilers that ignore it).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wall"
#pragma GCC diagnostic ignored "-Wextra"
#pragma GCC diagnostic ignored "-Wpedantic"
#pragma GCC diagnostic ignored "-Wshadow"
#include <cudnn_frontend.h>
#pragma GCC diagnostic pop

#include "bench/registry.h"

namespace trainscale::bench::cudnn {

namespace fe = cudnn_frontend;

// The graph tensor uid that a case tensor, named as the case declares it, binds to (0: not
// bound, e.g. our own workspace, which cuDNN does not use).
struct Binding {
  const char* name;
  std::int64_t uid;
};

// Describes a baseline's graph into `g`: data types, tensors with uids, operations, outputs.
// Throws Unsupported for what cuDNN's graph cannot express.
using DescribeGraph = std::function<void(fe::graph::Graph& g)>;

// cuDNN's data type for a case dtype; nothing for dtypes cuDNN has no I/O type for.
std::optional<fe::DataType_t> io_type(DType dtype);

// An implementation that only reports why it cannot run (an UNSUPPORTED row).
Implementation unsupported(std::string why);

// The baseline for case `c`. Finds the case's tensors by the names `bindings` gives, loads
// libcudnn, builds the graph `describe` gives (once per device, case and `params`, then cached
// for the process) and allocates its workspace here (declared as workspace_bytes), so only the
// execution is timed; the implementation binds those tensors (they must be contiguous). Never throws: whatever fails gives an implementation that reports itself
// Unsupported with the reason and the cuDNN that was loaded.
Implementation graph_baseline(const Case& c, std::vector<Binding> bindings, const std::string& params,
                              const DescribeGraph& describe);

}  // namespace trainscale::bench::cudnn
