#include "bench/registry.h"

#include <algorithm>
#include <charconv>

#include "trainscale/error.h"

namespace trainscale::bench {

const char* bound_name(Bound bound) { return bound == Bound::kMemory ? "memory" : "compute"; }

std::string shape_str(std::span<const std::int64_t> shape) {
  std::string s;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += 'x';
    s += std::to_string(shape[i]);
  }
  return s;
}

std::string Case::shape_str() const { return bench::shape_str(shape); }

std::string Case::name() const { return op + " " + shape_str() + " " + dtype_name(dtype); }

namespace {

std::int64_t spec_bytes(const TensorSpec& t) {
  std::int64_t n = 1;
  for (std::int64_t d : t.shape) n *= d;
  return n * static_cast<std::int64_t>(dtype_size(t.dtype));
}

}  // namespace

double Case::bytes_read() const {
  double bytes = 0;
  for (const TensorSpec& t : tensors) {
    if (has_input_data(t.role)) bytes += static_cast<double>(spec_bytes(t));
  }
  return bytes;
}

std::int64_t Case::scratch_bytes() const {
  std::int64_t bytes = 0;
  for (const TensorSpec& t : tensors) {
    if (t.role == Role::kScratch) bytes += spec_bytes(t);
  }
  return bytes;
}

TensorId Case::id(std::string_view name) const {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].name == name) return {i};
  }
  std::string declared;
  for (const TensorSpec& t : tensors) declared += (declared.empty() ? "" : ", ") + t.name;
  throw std::logic_error("bench case '" + op + "': no tensor named '" + std::string(name) +
                         "' (it declares " + (declared.empty() ? "none" : declared) + ")");
}

std::optional<DType> parse_dtype(const std::string& name) {
  static const std::map<std::string, DType> kNames = {
      {"fp64", DType::kFloat64},      {"float64", DType::kFloat64},
      {"fp32", DType::kFloat32},      {"float32", DType::kFloat32},
      {"fp16", DType::kFloat16},      {"float16", DType::kFloat16},
      {"bf16", DType::kBFloat16},     {"bfloat16", DType::kBFloat16},
      {"e4m3", DType::kFloat8E4M3},   {"float8_e4m3", DType::kFloat8E4M3},
      {"e5m2", DType::kFloat8E5M2},   {"float8_e5m2", DType::kFloat8E5M2},
  };
  const auto it = kNames.find(name);
  if (it == kNames.end()) return std::nullopt;
  return it->second;
}

std::optional<std::vector<std::int64_t>> parse_shape(const std::string& text) {
  std::vector<std::int64_t> dims;
  const char* p = text.data();
  const char* end = p + text.size();
  while (p < end) {
    std::int64_t v = 0;
    const auto [next, ec] = std::from_chars(p, end, v);
    if (ec != std::errc() || v < 0) return std::nullopt;
    dims.push_back(v);
    p = next;
    if (p == end) break;
    if (*p != 'x' && *p != 'X') return std::nullopt;
    if (++p == end) return std::nullopt;  // trailing separator
  }
  if (dims.empty()) return std::nullopt;
  return dims;
}

Registry::Registry() {
  for (const char* suite : kSuiteNames) suites_[suite];
}

Registry& Registry::global() {
  static Registry registry;
  return registry;
}

void Registry::add_op(OpInfo op) {
  if (ops_.count(op.name)) throw Error("trainscale-bench: op '" + op.name + "' registered twice");
  op_order_.push_back(op.name);
  ops_.emplace(op.name, std::move(op));
}

void Registry::add_configs(const std::string& suite, const std::string& op,
                           const std::vector<std::vector<std::int64_t>>& shapes,
                           const std::vector<DType>& dtypes) {
  const auto it = suites_.find(suite);
  if (it == suites_.end()) throw Error("trainscale-bench: unknown suite '" + suite + "' for op " + op);
  auto& configs = it->second;
  for (const auto& shape : shapes) {
    for (DType dtype : dtypes) configs.push_back({op, shape, dtype});
  }
}

void Registry::add_baseline(const std::string& op, std::string name, BaselineFactory factory, bool on_gpu) {
  baselines_.push_back({op, std::move(name), std::move(factory), on_gpu});
}

void Registry::add_opt_in(const std::string& op, std::string name, BaselineFactory factory, bool on_gpu) {
  baselines_.push_back({op, std::move(name), std::move(factory), on_gpu, /*opt_in=*/true});
}

const OpInfo* Registry::find_op(const std::string& name) const {
  const auto it = ops_.find(name);
  return it == ops_.end() ? nullptr : &it->second;
}

std::vector<std::string> Registry::op_names() const { return op_order_; }

std::vector<std::string> Registry::suite_names() const {
  return {std::begin(kSuiteNames), std::end(kSuiteNames)};
}

bool Registry::has_suite(const std::string& suite) const { return suites_.count(suite) > 0; }

const std::vector<Config>& Registry::suite(const std::string& suite) const {
  static const std::vector<Config> kEmpty;
  const auto it = suites_.find(suite);
  return it == suites_.end() ? kEmpty : it->second;
}

std::vector<std::string> Registry::names(bool opt_in) const {
  std::vector<std::string> names;
  for (const auto& b : baselines_) {
    if (b.opt_in == opt_in && std::find(names.begin(), names.end(), b.name) == names.end()) {
      names.push_back(b.name);
    }
  }
  return names;
}

std::vector<std::string> Registry::baseline_names() const { return names(false); }

std::vector<std::string> Registry::opt_in_names() const { return names(true); }

std::vector<Implementation> Registry::baselines_for(const Case& c, bool on_gpu,
                                                    const std::vector<std::string>& named) const {
  std::vector<Implementation> impls;
  for (const bool opt_in : {false, true}) {
    for (const auto& b : baselines_) {
      if (b.opt_in != opt_in || b.op != c.op || b.on_gpu != on_gpu) continue;
      if (opt_in && std::find(named.begin(), named.end(), b.name) == named.end()) continue;
      if (auto impl = b.factory(c)) {
        impl->name = b.name;
        impl->baseline = true;
        impl->on_gpu = b.on_gpu;
        impls.push_back(std::move(*impl));
      }
    }
  }
  return impls;
}

}  // namespace trainscale::bench
