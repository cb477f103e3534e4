// Helpers shared by the per-family case files: tensor specs, shape checks, and the shape
// lists of the suites (docs/contract.md) that several families use.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "bench/registry.h"

namespace trainscale::bench::cases {

using Shape = std::vector<std::int64_t>;

inline std::int64_t numel(std::span<const std::int64_t> shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

inline double bytes_of(DType dtype, std::span<const std::int64_t> shape) {
  return static_cast<double>(numel(shape)) * static_cast<double>(dtype_size(dtype));
}

// Sum of bytes over a case's tensors with the given roles: the "must move" traffic is usually
// every input read once plus every output written once.
double traffic(const std::vector<TensorSpec>& tensors);

inline TensorSpec input(std::string name, DType dtype, Shape shape, bool row_wise = true) {
  TensorSpec t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.role = Role::kInput;
  t.row_wise = row_wise;
  return t;
}

inline TensorSpec output(std::string name, DType dtype, Shape shape, bool row_wise = true) {
  TensorSpec t = input(std::move(name), dtype, std::move(shape), row_wise);
  t.role = Role::kOutput;
  return t;
}

inline TensorSpec in_out(std::string name, DType dtype, Shape shape, bool row_wise = true) {
  TensorSpec t = input(std::move(name), dtype, std::move(shape), row_wise);
  t.role = Role::kInOut;
  return t;
}

using Entry = std::function<void(CaseTensors tensors, cudaStream_t stream)>;

// A reference that is the entry's own call on the CPU views (no stream).
inline std::function<void(CaseTensors)> on_cpu(Entry entry) {
  return [entry = std::move(entry)](CaseTensors t) { entry(t, nullptr); };
}

// Workspace of `bytes` bytes for the CUDA path.
TensorSpec scratch(std::string name, std::int64_t bytes);
// A CUDA workspace size query, or 0 where it cannot be answered (no CUDA build or device).
std::int64_t cuda_workspace_bytes(const std::function<std::size_t()>& query);

// Throws Unsupported unless the config has `dims` dims (`doc` names them, e.g. "MxN").
void expect_dims(std::span<const std::int64_t> shape, std::size_t dims, const char* doc);

// A case with its identity filled in, after checking the config has `dims` dims.
Case begin_case(const char* op, const char* family, std::span<const std::int64_t> shape, DType dtype,
                std::size_t dims, const char* doc);

// Suite shapes for row ops (M rows of N; docs/contract.md, Suites).
std::vector<Shape> quack_shapes();    // M = 32768, N = 256 ... 65536; (16384, 131072); (8192, 262144)
std::vector<Shape> quack_m_shapes();  // N = 4096, M = batch * seq
std::vector<Shape> dsv3_row_shapes();  // M in {4096, 16384, 65536} x N in {6144, 7168, 8192}
std::vector<Shape> sweep_row_shapes();  // M = batch * seq, N = dim
std::vector<Shape> training_row_shapes();  // M in {2048, 4096, 8192, 16384} x N in {2048, 4096, 5120, 8192}
inline constexpr std::int64_t kLlamaTokens = 8192, kLlamaHidden = 4096, kLlamaFfn = 14336;
inline constexpr std::int64_t kLlamaHeads = 32, kLlamaKvHeads = 8, kLlamaHeadDim = 128, kLlamaVocab = 128256;

}  // namespace trainscale::bench::cases
