// Token embedding (embedding family): the table's gradient from the output gradient's rows,
// ids uniform over the table. Config T x V x H (tokens, table rows, row length). The traffic
// counts the output gradient and the ids read once and the whole table gradient written once.
#include "bench/cases/case_util.h"
#include "trainscale/embedding.h"

namespace trainscale::bench::cases {
namespace {

Case embedding_backward_case(std::span<const std::int64_t> shape, DType dtype) {
  Case c = begin_case("embedding_backward", "embedding", shape, dtype, 3, "TxVxH");
  const std::int64_t tokens = c.shape[0], vocab = c.shape[1], hidden = c.shape[2];
  TensorSpec ids = input("ids", DType::kInt64, {tokens});
  ids.lo = 0;
  ids.hi = static_cast<double>(vocab - 1);
  c.tensors = {input("grad_output", dtype, {tokens, hidden}), ids,
               output("grad_weight", dtype, {vocab, hidden}, /*row_wise=*/false),
               scratch("workspace", cuda_workspace_bytes([&] { return embedding_backward_workspace_bytes(tokens); }))};
  c.bytes = traffic(c.tensors);
  c.flops = static_cast<double>(tokens * hidden);  // one add per element of each token's row
  c.bound = Bound::kMemory;
  const auto [grad_output, ids_id, grad_weight, workspace] = c.ids("grad_output", "ids", "grad_weight", "workspace");
  c.entry = [=](CaseTensors t, cudaStream_t s) {
    embedding_backward(t[grad_output], t[ids_id], t[grad_weight], -1, t[workspace], s);
  };
  c.reference = on_cpu(c.entry);
  return c;
}

const Registrar kRegister([](Registry& r) {
  r.add_op({"embedding_backward", "embedding", "T x V x H (tokens, table rows, row length)", embedding_backward_case});
  r.add_configs("smoke", "embedding_backward", {{64, 1000, 64}, {37, 11, 5}}, {DType::kFloat32, DType::kBFloat16});
  r.add_configs("llama", "embedding_backward", {{kLlamaTokens, kLlamaVocab, kLlamaHidden}}, {DType::kBFloat16});
});

}  // namespace
}  // namespace trainscale::bench::cases
