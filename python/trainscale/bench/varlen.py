"""varlen: attention over packed sequences (a padding-free batch), causal, forward and forward
+ backward through autograd: ours (attention_varlen) against our batched kernel on the batch
padded to the longest sequence, PyTorch's SDPA on nested (jagged) tensors (FlashAttention's
varlen kernel on CUDA) and SDPA with a block-diagonal causal mask over the packed row (what a
model's sdpa attention does with such a mask); each gated on the relative L2 error of out (and
dq) against a float32 run of every sequence alone."""
import sys

import torch
import torch.nn.functional as F

from .measure import gate_call, recorded, result_row, suite_run, time_row

VARLEN_SUITE = "varlen"
VARLEN_DTYPE = torch.bfloat16
VARLEN_TOLERANCE = 1e-2  # the engine's bf16 tolerance (relative L2 error)
# (tokens, query heads, kv heads, head dim, mean sequence length): Llama-3 8B's heads.
VARLEN_SHAPES = [(16384, 32, 8, 128, 2048), (16384, 32, 8, 128, 512), (16384, 32, 8, 128, 128)]
VARLEN_CPU_SHAPES = [(40, 4, 2, 16, 8)]
VARLEN_OPS = ("attention_varlen_forward", "attention_varlen_forward_backward")


def _varlen_lengths(tokens, mean):
    """Sequence lengths cycling through 1/2, 3/2, 1/4 and 7/4 of the mean, the last one cut so
    that they sum to `tokens`."""
    pattern = [max(1, mean * k // 4) for k in (2, 6, 1, 7)]
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(pattern[len(lengths) % 4], tokens - sum(lengths)))
    return lengths


def varlen_implementations(use_gpu):
    """(name, is ours, fn) per implementation; fn(q, k, v, lengths, cu) -> out [T, Hq, D] for the
    packed q [T, Hq, D], k / v [T, Hkv, D], cu the int32 offsets on q's device."""
    from ..attention import attention, attention_varlen

    def varlen(q, k, v, lengths, cu):
        return attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)

    def padded(q, k, v, lengths, cu):
        # Causal: a query never sees the keys padded after its sequence's end.
        batch = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                        torch.tensor(lengths, device=q.device))
        position = torch.arange(q.shape[0], device=q.device) - cu.long()[batch]

        def pad(t):
            out = t.new_zeros(len(lengths), max(lengths), *t.shape[1:])
            return out.index_put((batch, position), t)
        return attention(pad(q), pad(k), pad(v), causal=True)[batch, position]

    def nested(q, k, v, lengths, cu):
        group = q.shape[1] // k.shape[1]
        offsets = cu.long()
        qn, kn, vn = (torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2)
                      for t in (q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)))
        return F.scaled_dot_product_attention(qn, kn, vn, is_causal=True).transpose(1, 2).values()

    def masked(q, k, v, lengths, cu):
        batch = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                        torch.tensor(lengths, device=q.device))
        mask = (batch[:, None] == batch[None, :]).tril()
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1)
    return [("trainscale" if use_gpu else "cpu-ref", True, varlen), ("trainscale-padded", False, padded),
            ("torch-sdpa-nested", False, nested), ("torch-sdpa-mask", False, masked)]


def _varlen_float32(q, k, v, lengths, cu, dout):
    """The gate's reference: out, and q's gradient for dout, every sequence alone in float32."""
    q32, k32, v32 = (t.detach().float().requires_grad_(t is q) for t in (q, k, v))
    outs = []
    for b, n in enumerate(lengths):
        s = slice(int(cu[b]), int(cu[b]) + n)
        outs.append(F.scaled_dot_product_attention(q32[s].transpose(0, 1)[None], k32[s].transpose(0, 1)[None],
                                                   v32[s].transpose(0, 1)[None], is_causal=True,
                                                   enable_gqa=True)[0].transpose(0, 1))
    out = torch.cat(outs)
    out.backward(dout.float())
    return out.detach(), q32.grad


def run_varlen(result, configs, impls, device, timing, seed, progress):
    """Appends the varlen suite's rows (result: the JSON document of docs/bench-json.md): each
    implementation on the same packed inputs, gated on out (and dq for forward + backward), then
    timed. FLOPs: the causal half of 4 L^2 D per query head and sequence (x 3.5 with the
    backward)."""
    gemm_tflops = (result.get("roofline") or {}).get("gemm_bf16_tflops")
    available = [i for i in varlen_implementations(device.type == "cuda") if not impls or i[0] in impls]
    generator = torch.Generator(device=device).manual_seed(seed)
    elem = torch.tensor([], dtype=VARLEN_DTYPE).element_size()
    with suite_run(result):
        for n, (op, (tokens, hq, hkv, d, mean)) in enumerate(configs):
            lengths = _varlen_lengths(tokens, mean)
            cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
            q = torch.randn(tokens, hq, d, generator=generator, device=device, dtype=VARLEN_DTYPE)
            k, v = (torch.randn(tokens, hkv, d, generator=generator, device=device, dtype=VARLEN_DTYPE)
                    for _ in range(2))
            dout = torch.randn(tokens, hq, d, generator=generator, device=device, dtype=VARLEN_DTYPE)
            ref_out, ref_dq = _varlen_float32(q, k, v, lengths, cu, dout)
            backward = op == "attention_varlen_forward_backward"
            forward_flops = sum(2 * n_ * n_ * d * hq for n_ in lengths)
            for x in (q, k, v):
                x.requires_grad_(backward)
            for name, ours, fn in available:
                row = result_row(op, "attention", f"{tokens}x{hq}x{hkv}x{d}x{mean}", VARLEN_DTYPE, name, ours, device,
                                  device.type == "cuda" and timing["flush_l2"],
                                  (2 * hq + 2 * hkv) * tokens * d * elem * (2 if backward else 1),
                                  forward_flops * (3.5 if backward else 1.0),
                                  {"tolerance": VARLEN_TOLERANCE, "rows_checked": tokens, "rows_total": tokens,
                                   "rows": "all"})
                if progress:
                    print(f"[varlen {n + 1}/{len(configs)}] {row['case']} [{name}]", file=sys.stderr, flush=True)
                with recorded(row, ours, result, device):
                    def call():
                        for x in (q, k, v):
                            x.grad = None
                        out = fn(q, k, v, lengths, cu)
                        if backward:
                            out.backward(dout)
                        return out
                    if not gate_call(row, call, ref_out, lambda: q.grad, ref_dq if backward else None,
                                      VARLEN_TOLERANCE):
                        continue
                    time_row(row, call, device, timing, gemm_tflops)
            del q, k, v, dout, ref_out, ref_dq
