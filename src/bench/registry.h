// How op families describe benchmark cases to the engine, which knows nothing about ops.
//
// A family registers, per op, a factory that builds a Case for a (shape, dtype): the tensors
// it touches, the bytes that must move and the FLOPs, which roofline applies, the call of our
// entry point, and the fp64 reference. It also lists the (shape, dtype) configs it contributes
// to each suite. Baselines (cuDNN, cuBLASLt, ...) attach to ops through add_baseline();
// opt-in implementations (our kernels with a variant forced, ...) through add_opt_in(): they
// run only when named in the selection's implementations, and are reported like baselines.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "bench/random_fill.h"
#include "trainscale/tensor.h"

namespace trainscale::bench {

enum class Bound { kMemory, kCompute };
const char* bound_name(Bound bound);

enum class Role {
  kInput,
  kOutput,
  kInOut,    // read and overwritten (in-place ops); compared like an output
  kScratch,  // workspace: allocated and poisoned, never compared, moves no counted bytes
};
// Random data goes into inputs; outputs and scratch start NaN-poisoned.
inline bool has_input_data(Role role) { return role == Role::kInput || role == Role::kInOut; }
inline bool is_checked_output(Role role) { return role == Role::kOutput || role == Role::kInOut; }

struct TensorSpec {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;
  Role role = Role::kInput;
  // Random inputs are uniform in [lo, hi] (integers: every value in [lo, hi]).
  double lo = -1.0, hi = 1.0;
  // Integer inputs: about this share of the elements holds `special` instead (RandomFill).
  double special_share = 0.0;
  std::int64_t special = 0;
  // dtype of this tensor in the reference call; unset: float64 for floating dtypes, unchanged
  // otherwise. Set it where the reference insists (float32 statistics, exact fp8 codes).
  std::optional<DType> reference_dtype;
  // Gate tolerance (relative L2) for outputs; unset: docs/contract.md's for `dtype`, 0 for fp8.
  std::optional<double> tolerance;
  // Dim 0 indexes the problem's rows. The gate may check a random subset of them when the case
  // says its rows are independent (Case::rows_independent), else the problem made of the first
  // rows (row-wise tensors cut to them, the others whole), which must then be the same op on
  // fewer rows. Either needs every row-wise tensor to have the rows as dim 0; a case whose
  // row-wise tensors disagree on dim 0 (a transposed output) is checked whole.
  bool row_wise = false;
  // The dim along which the case splits into Case::groups independent groups, or -1 (see there).
  int group_dim = -1;
};

// One of a case's tensors, resolved from the name its TensorSpec declares when the case is
// built (Case::id), so a call reads its view without a lookup.
struct TensorId {
  std::size_t index = 0;
};

// Views of a case's tensors, in the order of Case::tensors. Entry points and baselines read
// them by TensorId (there is no operator[] by position: a reordered list of specs then cannot
// feed the wrong buffer); code that walks every tensor with its spec uses all().
class CaseTensors {
 public:
  // Implicit: the engine and the gate pass their vectors of views as they are.
  CaseTensors(std::span<const TensorView> views) : views_(views) {}
  CaseTensors(const std::vector<TensorView>& views) : views_(views) {}
  const TensorView& operator[](TensorId id) const { return views_[id.index]; }
  std::span<const TensorView> all() const { return views_; }

 private:
  std::span<const TensorView> views_;
};

// Thrown by an implementation that cannot run this case (dtype, shape or device it lacks):
// the row is reported UNSUPPORTED, not FAILED.
class Unsupported : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One way to compute a case. `run` must be capturable in a CUDA graph on GPU.
struct Implementation {
  std::string name;  // "trainscale", "cpu-ref", "cudnn", "trainscale-rows", ...
  bool on_gpu = true;
  bool baseline = false;  // baselines and opt-in implementations: paired with ours in reports
  std::function<void(CaseTensors tensors, cudaStream_t stream)> run;
  // The gate's call, when it differs from `run`: an implementation that returns fresh outputs
  // (PyTorch callables) copies them into the case's tensors here, and `run`, which is timed,
  // does not. Unset: `run`.
  std::function<void(CaseTensors tensors, cudaStream_t stream)> gate_run;
  // Scratch memory the implementation allocates per call (counted in peak memory).
  std::int64_t workspace_bytes = 0;
  // Whether `run` may be captured in a CUDA graph (batch mode). PyTorch callables may not: the
  // caching allocator must not allocate inside a capture it did not start.
  bool capturable = true;
};

// Rows of one output that a case's own check (SampledCheck) reads back from the gated call.
struct OutputRead {
  TensorId output;
  std::vector<std::int64_t> rows;  // indices along dim 0; empty: the whole tensor
};

// What a case's own check reads, and what the reports say it covers.
struct SamplePlan {
  std::vector<OutputRead> reads;
  std::int64_t rows_checked = 0, rows_total = 0;  // of the problem's rows (tokens, ...)
  std::string scope;  // which rows of which outputs are checked, and how, in words
};

// Values of one output from the implementation next to their fp64 reference; the gate compares
// them at the output's tolerance.
struct SampledValues {
  TensorId output;
  std::vector<double> out, ref;
};

// The gate of a compute-bound case whose whole fp64 reference would take minutes on the host
// and whose rows are coupled (a weight gradient sums over all of them), so that neither a row
// sample nor a prefix problem is the same computation: the case checks sampled rows of the full
// call its own way, in fp64 from the inputs' fills and what it reads back.
struct SampledCheck {
  // The rows to read, chosen from `seed` for about `flops` FLOPs of host work. `fills` (one per
  // tensor, in Case::tensors' order) say what every input holds.
  std::function<SamplePlan(std::uint64_t seed, double flops, std::span<const RandomFill> fills)> plan;
  // The checked values and their references, from what was read (in plan.reads' order) and the
  // inputs' fills. Runs on the gate's worker thread.
  std::function<std::vector<SampledValues>(const SamplePlan& plan, std::span<const RandomFill> fills,
                                           const std::vector<std::vector<double>>& read)>
      check;
};

struct Case {
  std::string op;      // "rmsnorm_forward"
  std::string family;  // "norm"
  std::vector<std::int64_t> shape;
  DType dtype = DType::kBFloat16;
  std::vector<TensorSpec> tensors;
  double bytes = 0;  // that must move: each input read once, each output written once
  double flops = 0;
  Bound bound = Bound::kMemory;
  // Our entry point; the engine calls it with CPU views ("cpu-ref") or CUDA views
  // ("trainscale").
  std::function<void(CaseTensors tensors, cudaStream_t stream)> entry;
  // The fp64 reference on CPU views whose dtypes follow TensorSpec::reference_dtype.
  std::function<void(CaseTensors tensors)> reference;
  // Row i of every row_wise output depends only on row i of the row_wise inputs (and on the
  // other, whole, tensors): the gate may sample rows of large cases. Otherwise (a weight
  // gradient sums over rows) it may gate large cases on a prefix problem (GateLimits).
  bool rows_independent = false;
  // Compute-bound cases too costly for a whole fp64 reference on the host may split into this
  // many independent groups (attention: the kv heads, each with its query heads): every tensor
  // with a TensorSpec::group_dim holds shape[group_dim] / groups slices per group there, and group
  // g of the outputs depends only on group g of the inputs. The gate then checks a run of
  // consecutive groups. 0: no groups.
  std::int64_t groups = 0;
  // Replaces `reference` above GateLimits::reference_flops (see SampledCheck).
  std::optional<SampledCheck> sampled_check;
  // Rows coupled and the cost superlinear in them (Newton-Schulz): the case's FLOPs with only
  // its first `rows` rows. Above GateLimits::reference_flops the gate checks the prefix problem
  // of as many rows as stay within them. With `groups`, the FLOPs of one group with its first
  // `rows` rows (dim 1 of the group_dim-0 tensors): where one group alone exceeds the budget,
  // the gate checks that prefix problem of the first group.
  std::function<double(std::int64_t rows)> flops_of_rows;

  // The tensor this case declares as `name`; throws std::logic_error, naming the case's tensors,
  // for a name it does not declare.
  TensorId id(std::string_view name) const;
  template <class... Names>
  std::array<TensorId, sizeof...(Names)> ids(const Names&... names) const {
    return {id(names)...};
  }

  // The spec of the tensor declared as `name` (same error as id()).
  TensorSpec& spec(std::string_view name) { return tensors[id(name).index]; }

  std::string shape_str() const;  // "32768x4096"
  std::string name() const;       // "rmsnorm_forward 32768x4096 bfloat16"
  std::int64_t scratch_bytes() const;  // of its Role::kScratch tensors
  double bytes_read() const;           // of its inputs and in-place tensors, each once
};

// Builds an op's case for one config; throws Unsupported for a shape or dtype it lacks.
using CaseFactory = std::function<Case(std::span<const std::int64_t> shape, DType dtype)>;
// Returns a baseline for a case, or nothing when it does not apply.
using BaselineFactory = std::function<std::optional<Implementation>(const Case& c)>;

struct OpInfo {
  std::string name;
  std::string family;
  std::string shape_doc;  // what the shape dims mean, e.g. "M x N"
  CaseFactory make;
};

struct Config {
  std::string op;
  std::vector<std::int64_t> shape;
  DType dtype;
};

// The suites of docs/contract.md; configs may only be added to these.
inline constexpr const char* kSuiteNames[] = {"smoke", "quack", "quack-m", "dsv3", "llama",
                                              "attention", "flce", "muon", "sweep", "training"};

class Registry {
 public:
  Registry();
  // The process-wide registry that case files fill at static-initialization time.
  static Registry& global();

  void add_op(OpInfo op);
  void add_configs(const std::string& suite, const std::string& op,
                   const std::vector<std::vector<std::int64_t>>& shapes,
                   const std::vector<DType>& dtypes);
  // `on_gpu`: the device the baseline runs on (CUDA baselines are only built on a GPU run).
  void add_baseline(const std::string& op, std::string name, BaselineFactory factory, bool on_gpu = true);
  // Like a baseline, but run only when named (Selection::impls), e.g. a forced kernel variant.
  void add_opt_in(const std::string& op, std::string name, BaselineFactory factory, bool on_gpu = true);

  const OpInfo* find_op(const std::string& name) const;
  std::vector<std::string> op_names() const;
  std::vector<std::string> suite_names() const;
  bool has_suite(const std::string& suite) const;
  // Configs of a suite in registration order.
  const std::vector<Config>& suite(const std::string& suite) const;
  std::vector<std::string> baseline_names() const;
  std::vector<std::string> opt_in_names() const;
  // Every baseline on that device (GPU or CPU) that applies to the case, then the opt-in
  // implementations among `named` that do.
  std::vector<Implementation> baselines_for(const Case& c, bool on_gpu,
                                            const std::vector<std::string>& named = {}) const;

 private:
  std::map<std::string, OpInfo> ops_;
  std::vector<std::string> op_order_;
  std::map<std::string, std::vector<Config>> suites_;
  struct Baseline {
    std::string op, name;
    BaselineFactory factory;
    bool on_gpu = true;
    bool opt_in = false;
  };
  std::vector<std::string> names(bool opt_in) const;
  std::vector<Baseline> baselines_;
};

// `static Registrar r([](Registry& reg) { ... });` in a case file registers at start-up.
struct Registrar {
  explicit Registrar(const std::function<void(Registry&)>& fn) { fn(Registry::global()); }
};

std::string shape_str(std::span<const std::int64_t> shape);  // "32768x4096"
// "bf16" / "bfloat16", "fp32" / "float32", ...; nullopt when unknown.
std::optional<DType> parse_dtype(const std::string& name);
// "32768x4096" -> {32768, 4096}; nullopt when malformed.
std::optional<std::vector<std::int64_t>> parse_shape(const std::string& text);

}  // namespace trainscale::bench
