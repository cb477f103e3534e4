#include "bench/cases/case_util.h"

namespace trainscale::bench::cases {

double traffic(const std::vector<TensorSpec>& tensors) {
  double bytes = 0;
  for (const TensorSpec& t : tensors) {
    if (t.role == Role::kScratch) continue;
    // An in-place tensor is read and written.
    bytes += bytes_of(t.dtype, t.shape) * (t.role == Role::kInOut ? 2.0 : 1.0);
  }
  return bytes;
}

TensorSpec scratch(std::string name, std::int64_t bytes) {
  // int32 elements; CUDA workspaces are 16-byte multiples anyway.
  TensorSpec t = output(std::move(name), DType::kInt32, {(bytes + 3) / 4}, /*row_wise=*/false);
  t.role = Role::kScratch;
  return t;
}

std::int64_t cuda_workspace_bytes(const std::function<std::size_t()>& query) {
  try {
    return static_cast<std::int64_t>(query());
  } catch (const std::exception&) {
    return 0;  // no CUDA build or device: the CPU path ignores the workspace
  }
}

void expect_dims(std::span<const std::int64_t> shape, std::size_t dims, const char* doc) {
  if (shape.size() != dims) {
    throw Unsupported("expects a " + std::to_string(dims) + "-dim config " + doc + ", got " + shape_str(shape));
  }
}

Case begin_case(const char* op, const char* family, std::span<const std::int64_t> shape, DType dtype,
                std::size_t dims, const char* doc) {
  expect_dims(shape, dims, doc);
  Case c;
  c.op = op;
  c.family = family;
  c.shape.assign(shape.begin(), shape.end());
  c.dtype = dtype;
  return c;
}

std::vector<Shape> quack_shapes() {
  std::vector<Shape> shapes;
  for (std::int64_t n = 256; n <= 65536; n *= 2) shapes.push_back({32768, n});
  shapes.push_back({16384, 131072});
  shapes.push_back({8192, 262144});
  return shapes;
}

std::vector<Shape> quack_m_shapes() {
  std::vector<Shape> shapes;
  for (std::int64_t batch : {1, 4, 8, 16, 32}) {
    for (std::int64_t seq = 8192; seq <= 131072; seq *= 2) shapes.push_back({batch * seq, 4096});
  }
  return shapes;
}

std::vector<Shape> dsv3_row_shapes() {
  std::vector<Shape> shapes;
  for (std::int64_t m : {4096, 16384, 65536}) {
    for (std::int64_t n : {6144, 7168, 8192}) shapes.push_back({m, n});
  }
  return shapes;
}

std::vector<Shape> sweep_row_shapes() {
  std::vector<Shape> shapes;
  for (std::int64_t batch : {16, 32, 64, 128}) {
    for (std::int64_t seq : {256, 512, 1024, 2048}) {
      for (std::int64_t dim : {8, 16, 32, 64, 128, 256, 512, 768, 4096}) shapes.push_back({batch * seq, dim});
    }
  }
  return shapes;
}

std::vector<Shape> training_row_shapes() {
  std::vector<Shape> shapes;
  for (std::int64_t m : {2048, 4096, 8192, 16384}) {
    for (std::int64_t n : {2048, 4096, 5120, 8192}) shapes.push_back({m, n});
  }
  return shapes;
}

}  // namespace trainscale::bench::cases
