#include "bench/baselines/cudnn_baselines.h"

#if TRAINSCALE_HAVE_CUDA && TRAINSCALE_HAVE_CUDNN_FRONTEND

#include "bench/baselines/cudnn_graph.h"

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "bench/cuda_util.h"

namespace cudnn_frontend {
// The handle the frontend's dynamic-loading shims dlsym() from; one definition per program.
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace trainscale::bench {

bool cudnn_baselines_built() { return true; }

namespace cudnn {
namespace {

// ---- libcudnn, loaded once ----------------------------------------------------------------

struct CudnnLibrary {
  bool ok = false;
  std::string error;    // why it could not be loaded
  std::string path;     // what was loaded
  std::size_t version = 0;
};

std::string version_str(std::size_t v) {
  // cuDNN 9: major * 10000 + minor * 100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

// The frontend dlopen()s a libcudart of its own for the few runtime calls it makes; point it at
// the one this program uses (it would otherwise take libcudart.so.12 first where both exist).
void pin_frontend_cudart() {
  if (std::getenv("CUDNN_FRONTEND_CUDART_LIB_NAME")) return;
  Dl_info info{};
  std::string name;
  if (dladdr(reinterpret_cast<void*>(&cudaRuntimeGetVersion), &info) != 0 && info.dli_fname &&
      std::string(info.dli_fname).find("libcudart.so") != std::string::npos) {
    name = info.dli_fname;
  } else {
    name = "libcudart.so." + std::to_string(CUDART_VERSION / 1000);
  }
  setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", name.c_str(), 0);
}

const CudnnLibrary& cudnn_library() {
  static const CudnnLibrary library = [] {
    CudnnLibrary lib;
    std::vector<std::string> candidates;
    if (const char* dir = std::getenv("TRAINSCALE_CUDNN_LIB_DIR"); dir && *dir) {
      candidates.push_back(std::string(dir) + "/libcudnn.so.9");
    }
    candidates.push_back("libcudnn.so.9");
    std::string errors;
    for (const std::string& name : candidates) {
      dlerror();
      void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!handle) {
        const char* e = dlerror();
        errors += (errors.empty() ? "" : "; ") + (e ? std::string(e) : name + ": cannot be opened");
        continue;
      }
      using GetVersion = std::size_t (*)();
      const auto get_version = reinterpret_cast<GetVersion>(dlsym(handle, "cudnnGetVersion"));
      const std::size_t version = get_version ? get_version() : 0;
      if (version < 90000) {
        errors += (errors.empty() ? "" : "; ") + name + ": " +
                  (get_version ? "cuDNN " + version_str(version) + ", 9.x needed" : "no cudnnGetVersion");
        dlclose(handle);
        continue;
      }
      Dl_info info{};
      lib.path = dladdr(reinterpret_cast<void*>(get_version), &info) != 0 && info.dli_fname ? info.dli_fname : name;
      lib.version = version;
      lib.ok = true;
      fe::cudnn_dlhandle = handle;
      pin_frontend_cudart();
      return lib;
    }
    lib.error = "cannot load libcudnn.so.9 (" + errors +
                "); set TRAINSCALE_CUDNN_LIB_DIR to the directory that holds it";
    return lib;
  }();
  return library;
}

// ---- handles and graphs, built once and kept for the life of the process -------------------

std::mutex& cache_mutex() {
  static std::mutex& m = *new std::mutex;  // leaked: no teardown order issues at exit
  return m;
}

int current_device() {
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

// One cuDNN handle per device (leaked on purpose: destroying it after the CUDA runtime has
// shut down at exit is unsafe, and the process is ending anyway).
cudnnHandle_t handle_for_current_device() {
  const int device = current_device();
  static auto& handles = *new std::map<int, cudnnHandle_t>;
  std::lock_guard<std::mutex> lock(cache_mutex());
  if (auto it = handles.find(device); it != handles.end()) return it->second;
  cudnnHandle_t handle = nullptr;
  const cudnnStatus_t status = fe::detail::create_handle(&handle);
  if (status != CUDNN_STATUS_SUCCESS) {
    throw Unsupported("cudnn: cudnnCreate failed with status " + std::to_string(static_cast<int>(status)));
  }
  handles.emplace(device, handle);
  return handle;
}

// cuDNN's messages can run over several lines (engine configs as JSON): one line for a row.
std::string one_line(std::string text) {
  constexpr std::size_t kMax = 400;
  for (char& ch : text) {
    if (ch == '\n' || ch == '\r' || ch == '\t') ch = ' ';
  }
  while (!text.empty() && text.back() == ' ') text.pop_back();
  if (text.size() > kMax) text = text.substr(0, kMax) + "...";
  return text;
}

void expect_good(fe::error_t status, const char* step) {
  if (status.is_bad()) throw Unsupported(one_line(std::string("cudnn: ") + step + ": " + status.get_message()));
}

struct BuiltGraph {
  fe::graph::Graph graph;
  std::int64_t workspace_bytes = 0;
};

std::shared_ptr<const BuiltGraph> build_graph(const DescribeGraph& describe, cudnnHandle_t handle) {
  auto built = std::make_shared<BuiltGraph>();
  fe::graph::Graph& g = built->graph;
  describe(g);
  expect_good(g.validate(), "validate");
  expect_good(g.build_operation_graph(handle), "build_operation_graph");
  expect_good(g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), "create_execution_plans");
  expect_good(g.check_support(handle), "check_support");
  expect_good(g.build_plans(handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build_plans");
  expect_good(g.get_workspace_size(built->workspace_bytes), "get_workspace_size");
  return built;
}

// Built graphs by device and key; kept for the process (leaked, like the handles they were
// built with), so a case that comes back reuses its graph.
std::shared_ptr<const BuiltGraph> cached_graph(const std::string& key, const DescribeGraph& describe,
                                               cudnnHandle_t handle) {
  const std::string device_key = std::to_string(current_device()) + "/" + key;
  static auto& graphs = *new std::map<std::string, std::shared_ptr<const BuiltGraph>>;
  {
    std::lock_guard<std::mutex> lock(cache_mutex());
    if (auto it = graphs.find(device_key); it != graphs.end()) return it->second;
  }
  auto built = build_graph(describe, handle);
  std::lock_guard<std::mutex> lock(cache_mutex());
  return graphs.emplace(device_key, std::move(built)).first->second;
}

}  // namespace

std::optional<fe::DataType_t> io_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return fe::DataType_t::FLOAT;
    case DType::kFloat16: return fe::DataType_t::HALF;
    case DType::kBFloat16: return fe::DataType_t::BFLOAT16;
    default: return std::nullopt;
  }
}

Implementation unsupported(std::string why) {
  Implementation impl;
  impl.run = [why = std::move(why)](CaseTensors, cudaStream_t) { throw Unsupported(why); };
  return impl;
}

Implementation graph_baseline(const Case& c, std::vector<Binding> bindings, const std::string& params,
                              const DescribeGraph& describe) {
  // Each bound tensor's place in the case, resolved once.
  struct Bound {
    TensorId id;
    std::int64_t uid;
    const char* name;
  };
  std::vector<Bound> bound;
  for (const Binding& b : bindings) {
    if (b.uid == 0) continue;
    const bool declared = std::any_of(c.tensors.begin(), c.tensors.end(),
                                      [&](const TensorSpec& spec) { return spec.name == b.name; });
    if (!declared) return unsupported("cudnn: case " + c.name() + " has no tensor '" + b.name + "'");
    bound.push_back({c.id(b.name), b.uid, b.name});
  }
  const CudnnLibrary& lib = cudnn_library();
  if (!lib.ok) return unsupported("cudnn: " + lib.error);

  try {
    const cudnnHandle_t handle = handle_for_current_device();
    auto graph = cached_graph(c.name() + "/" + params, describe, handle);
    auto workspace = std::make_shared<DeviceBuffer>(graph->workspace_bytes, "cudaMalloc (cuDNN workspace)");
    Implementation impl;
    impl.workspace_bytes = graph->workspace_bytes;
    impl.run = [graph, workspace, handle, bound = std::move(bound)](CaseTensors t, cudaStream_t stream) {
      std::unordered_map<std::int64_t, void*> pack;
      for (const Bound& b : bound) {
        if (!t[b.id].is_contiguous()) throw Unsupported(std::string("cudnn: '") + b.name + "' is not contiguous");
        pack.emplace(b.uid, t[b.id].data);
      }
      const cudnnStatus_t status = fe::detail::set_stream(handle, stream);
      if (status != CUDNN_STATUS_SUCCESS) {
        throw Error("cudnn: cudnnSetStream failed with status " + std::to_string(static_cast<int>(status)));
      }
      fe::error_t result = graph->graph.execute(handle, pack, workspace->data);
      if (result.is_bad()) throw Error(one_line("cudnn: execute: " + result.get_message()));
    };
    return impl;
  } catch (const std::exception& e) {
    // Unsupported (no engine for this shape or dtype) or a setup error: either way no row to time.
    return unsupported(one_line(e.what()) + " [cuDNN " + version_str(lib.version) + " from " + lib.path + "]");
  }
}

}  // namespace cudnn
}  // namespace trainscale::bench

#else  // no cuDNN frontend in this build

namespace trainscale::bench {

bool cudnn_baselines_built() { return false; }

}  // namespace trainscale::bench

#endif
