#include "bench/baselines/cudnn_norm.h"

#if TRAINSCALE_HAVE_CUDA && TRAINSCALE_HAVE_CUDNN_FRONTEND

// The frontend resolves every cuDNN call through cudnn_frontend::cudnn_dlhandle (set below once
// libcudnn is loaded), so nothing links against libcudnn.
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING 1
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

// Third-party headers (found through -isystem; the pragmas cover compilers that ignore it).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wall"
#pragma GCC diagnostic ignored "-Wextra"
#pragma GCC diagnostic ignored "-Wpedantic"
#pragma GCC diagnostic ignored "-Wshadow"
#include <cudnn_frontend.h>
#pragma GCC diagnostic pop

#include "bench/cuda_util.h"

namespace cudnn_frontend {
// The handle the frontend's dynamic-loading shims dlsym() from; one definition per program.
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace trainscale::bench {

bool cudnn_norm_built() { return true; }

namespace {

namespace fe = cudnn_frontend;

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

// One cuDNN handle per device (leaked on purpose: destroying it after the CUDA runtime has
// shut down at exit is unsafe, and the process is ending anyway).
cudnnHandle_t handle_for_current_device() {
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
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

// Graph tensor uids.
enum Uid : std::int64_t { kX = 1, kWeight, kBias, kY, kMean, kRstd, kDy, kDx, kDw, kDb };

struct NormGraph {
  fe::graph::Graph graph;
  std::int64_t workspace_bytes = 0;
};

// The case's tensors, in order, and the graph tensor each binds to (0: not bound, e.g. our own
// backward workspace, which cuDNN does not use).
struct Binding {
  const char* name;
  std::int64_t uid;
};

std::vector<Binding> bindings_of(CudnnNormOp op) {
  switch (op) {
    case CudnnNormOp::kRmsNormForward:
      return {{"x", kX}, {"weight", kWeight}, {"y", kY}, {"rstd", kRstd}};
    case CudnnNormOp::kRmsNormBackward:
      return {{"dy", kDy}, {"x", kX}, {"weight", kWeight}, {"rstd", kRstd},
              {"dx", kDx}, {"dw", kDw}, {"workspace", 0}};
    case CudnnNormOp::kLayerNormForward:
      return {{"x", kX}, {"weight", kWeight}, {"bias", kBias}, {"y", kY}, {"mean", kMean}, {"rstd", kRstd}};
    case CudnnNormOp::kLayerNormBackward:
      return {{"dy", kDy}, {"x", kX},   {"weight", kWeight}, {"mean", kMean},      {"rstd", kRstd},
              {"dx", kDx}, {"dw", kDw}, {"db", kDb},         {"workspace", 0}};
  }
  return {};
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

// M rows of N as cuDNN's 4-d [M, N, 1, 1] (the normalized axis is dim 1), per-feature tensors as
// [1, N, 1, 1] and per-row statistics as [M, 1, 1, 1]; statistics are float32 like ours.
std::shared_ptr<const NormGraph> build_graph(CudnnNormOp op, std::int64_t m, std::int64_t n, fe::DataType_t io,
                                             float eps, cudnnHandle_t handle) {
  auto ng = std::make_shared<NormGraph>();
  fe::graph::Graph& g = ng->graph;
  g.set_io_data_type(io).set_intermediate_data_type(fe::DataType_t::FLOAT).set_compute_data_type(fe::DataType_t::FLOAT);
  const auto rows = [&](const char* name, std::int64_t uid, fe::DataType_t dtype) {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_data_type(dtype)
                        .set_dim({m, n, 1, 1}).set_stride({n, 1, n, n}));
  };
  const auto feature = [&](const char* name, std::int64_t uid) {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_data_type(io)
                        .set_dim({1, n, 1, 1}).set_stride({n, 1, n, n}));
  };
  const auto stat = [&](const char* name, std::int64_t uid) {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_data_type(fe::DataType_t::FLOAT)
                        .set_dim({m, 1, 1, 1}).set_stride({1, 1, 1, 1}));
  };
  const auto output = [](const std::shared_ptr<fe::graph::Tensor_attributes>& t, std::int64_t uid, fe::DataType_t dtype,
                         std::vector<std::int64_t> dim, std::vector<std::int64_t> stride) {
    if (!t) throw Unsupported("cudnn: the graph lacks an output");
    t->set_output(true).set_uid(uid).set_data_type(dtype).set_dim(std::move(dim)).set_stride(std::move(stride));
  };
  const std::vector<std::int64_t> rows_dim{m, n, 1, 1}, rows_stride{n, 1, n, n};
  const std::vector<std::int64_t> feature_dim{1, n, 1, 1}, feature_stride{n, 1, n, n};
  const std::vector<std::int64_t> stat_dim{m, 1, 1, 1}, stat_stride{1, 1, 1, 1};

  switch (op) {
    case CudnnNormOp::kRmsNormForward: {
      auto x = rows("x", kX, io);
      auto w = feature("weight", kWeight);
      auto epsilon = g.tensor(fe::graph::Tensor_attributes(eps));
      epsilon->set_name("epsilon");
      auto attrs = fe::graph::Rmsnorm_attributes()
                       .set_forward_phase(fe::NormFwdPhase_t::TRAINING)
                       .set_epsilon(epsilon)
                       .set_compute_data_type(fe::DataType_t::FLOAT);
      auto [y, rstd] = g.rmsnorm(x, w, attrs);
      output(y, kY, io, rows_dim, rows_stride);
      output(rstd, kRstd, fe::DataType_t::FLOAT, stat_dim, stat_stride);
      break;
    }
    case CudnnNormOp::kRmsNormBackward: {
      auto dy = rows("dy", kDy, io);
      auto x = rows("x", kX, io);
      auto w = feature("weight", kWeight);
      auto rstd = stat("rstd", kRstd);
      auto attrs = fe::graph::Rmsnorm_backward_attributes().has_dbias(false).set_compute_data_type(fe::DataType_t::FLOAT);
      auto [dx, dw, db] = g.rmsnorm_backward(dy, x, w, rstd, attrs);
      if (db) throw Unsupported("cudnn: rmsnorm_backward returned a bias gradient that was not asked for");
      output(dx, kDx, io, rows_dim, rows_stride);
      output(dw, kDw, io, feature_dim, feature_stride);
      break;
    }
    case CudnnNormOp::kLayerNormForward: {
      auto x = rows("x", kX, io);
      auto w = feature("weight", kWeight);
      auto b = feature("bias", kBias);
      auto epsilon = g.tensor(fe::graph::Tensor_attributes(eps));
      epsilon->set_name("epsilon");
      auto attrs = fe::graph::Layernorm_attributes()
                       .set_forward_phase(fe::NormFwdPhase_t::TRAINING)
                       .set_epsilon(epsilon)
                       .set_compute_data_type(fe::DataType_t::FLOAT);
      auto [y, mean, rstd] = g.layernorm(x, w, b, attrs);
      output(y, kY, io, rows_dim, rows_stride);
      output(mean, kMean, fe::DataType_t::FLOAT, stat_dim, stat_stride);
      output(rstd, kRstd, fe::DataType_t::FLOAT, stat_dim, stat_stride);
      break;
    }
    case CudnnNormOp::kLayerNormBackward: {
      auto dy = rows("dy", kDy, io);
      auto x = rows("x", kX, io);
      auto w = feature("weight", kWeight);
      auto mean = stat("mean", kMean);
      auto rstd = stat("rstd", kRstd);
      auto attrs = fe::graph::Layernorm_backward_attributes()
                       .set_saved_mean_and_inv_variance(mean, rstd)
                       .set_compute_data_type(fe::DataType_t::FLOAT);
      auto [dx, dw, db] = g.layernorm_backward(dy, x, w, attrs);
      output(dx, kDx, io, rows_dim, rows_stride);
      output(dw, kDw, io, feature_dim, feature_stride);
      output(db, kDb, io, feature_dim, feature_stride);
      break;
    }
  }

  expect_good(g.validate(), "validate");
  expect_good(g.build_operation_graph(handle), "build_operation_graph");
  expect_good(g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), "create_execution_plans");
  expect_good(g.check_support(handle), "check_support");
  expect_good(g.build_plans(handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build_plans");
  expect_good(g.get_workspace_size(ng->workspace_bytes), "get_workspace_size");
  return ng;
}

// Built graphs by (device, op, shape, dtype, eps); kept for the process (leaked, like the
// handles they were built with), so a case that comes back reuses its graph.
std::shared_ptr<const NormGraph> cached_graph(CudnnNormOp op, std::int64_t m, std::int64_t n, fe::DataType_t io,
                                              float eps, cudnnHandle_t handle) {
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  char eps_hex[32];
  std::snprintf(eps_hex, sizeof eps_hex, "%a", static_cast<double>(eps));  // exact
  const std::string key = std::to_string(device) + "/" + std::to_string(static_cast<int>(op)) + "/" + std::to_string(m) +
                          "x" + std::to_string(n) + "/" + std::to_string(static_cast<int>(io)) + "/" + eps_hex;
  static auto& graphs = *new std::map<std::string, std::shared_ptr<const NormGraph>>;
  {
    std::lock_guard<std::mutex> lock(cache_mutex());
    if (auto it = graphs.find(key); it != graphs.end()) return it->second;
  }
  auto built = build_graph(op, m, n, io, eps, handle);
  std::lock_guard<std::mutex> lock(cache_mutex());
  return graphs.emplace(key, std::move(built)).first->second;
}

// Device memory owned by one implementation (its workspace).
struct DeviceBuffer {
  void* data = nullptr;
  explicit DeviceBuffer(std::int64_t bytes) {
    if (bytes > 0) cuda_check(cudaMalloc(&data, static_cast<std::size_t>(bytes)), "cudaMalloc (cuDNN workspace)");
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (data) cudaFree(data);
  }
};

std::optional<fe::DataType_t> io_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return fe::DataType_t::FLOAT;
    case DType::kFloat16: return fe::DataType_t::HALF;
    case DType::kBFloat16: return fe::DataType_t::BFLOAT16;
    default: return std::nullopt;
  }
}

// An implementation that only reports why it cannot run (an UNSUPPORTED row).
Implementation unsupported(std::string why) {
  Implementation impl;
  impl.run = [why = std::move(why)](Views, cudaStream_t) { throw Unsupported(why); };
  return impl;
}

}  // namespace

std::optional<Implementation> cudnn_norm_baseline(CudnnNormOp op, const Case& c, double eps, double weight_offset) {
  const std::optional<fe::DataType_t> io = io_type(c.dtype);
  if (!io) return std::nullopt;
  if (weight_offset != 0.0) return unsupported("cudnn: RMSNorm weight offset " + std::to_string(weight_offset));
  const std::vector<Binding> bindings = bindings_of(op);
  if (c.shape.size() != 2 || c.tensors.size() != bindings.size()) {
    return unsupported("cudnn: case " + c.name() + " is not laid out as the cuDNN baseline expects");
  }
  for (std::size_t i = 0; i < bindings.size(); ++i) {
    if (c.tensors[i].name != bindings[i].name) {
      return unsupported("cudnn: case " + c.name() + " tensor " + std::to_string(i) + " is '" + c.tensors[i].name +
                         "', expected '" + bindings[i].name + "'");
    }
  }
  const CudnnLibrary& lib = cudnn_library();
  if (!lib.ok) return unsupported("cudnn: " + lib.error);

  try {
    const cudnnHandle_t handle = handle_for_current_device();
    auto graph = cached_graph(op, c.shape[0], c.shape[1], *io, static_cast<float>(eps), handle);
    auto workspace = std::make_shared<DeviceBuffer>(graph->workspace_bytes);
    Implementation impl;
    impl.workspace_bytes = graph->workspace_bytes;
    impl.run = [graph, workspace, handle, bindings](Views t, cudaStream_t stream) {
      std::unordered_map<std::int64_t, void*> pack;
      for (std::size_t i = 0; i < bindings.size(); ++i) {
        if (bindings[i].uid == 0) continue;
        if (!t[i].is_contiguous()) throw Unsupported(std::string("cudnn: '") + bindings[i].name + "' is not contiguous");
        pack.emplace(bindings[i].uid, t[i].data);
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

}  // namespace trainscale::bench

#else  // no cuDNN frontend in this build

namespace trainscale::bench {

bool cudnn_norm_built() { return false; }

std::optional<Implementation> cudnn_norm_baseline(CudnnNormOp, const Case&, double, double) { return std::nullopt; }

}  // namespace trainscale::bench

#endif
