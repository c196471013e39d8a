"""The wgmma decode kernel's arithmetic on an fp8_ds_mla cache, replayed on the CPU.

    PYTHONPATH=. python3 benchmarks/lab/model_sm90_ds_mla_fp16.py

Decode row 74 (``candidates/dsfp16.patch``) moves ``csrc/mla_decode_sm90.cu``'s fp8_ds_mla products
from q's dtype to fp16: a 64-token tile's values come in as fp16(e4m3) x fp16(scale / 2^F), F a
power of two from the tile's largest scale (``tile_exponent``), the rope block as bf16 x 2^-F, q's
latent part as fp16(q x q_scale) and its rope part as bf16(q x q_scale); S takes 2^F back in
float32, p goes to fp16 times 2^(F - G), G the largest F so far, and the output takes 2^G back at
the end. This script computes that rounding, and the kernel's before it (e4m3 x scale in float32
rounded to bf16, q and p in bf16), in float64 from the rounded operands, against the float64
attention over the dequantised cache, on the GPU tests' kind of cache (DeepSeek-V3 sizes, the
latent's groups 1, 2, 4, 8 times as large) and on the same cache with its values 2^30 and 2^-40
times as large, and with its pages (a tile each) 2^-12, 1 and 2^12 times as large in turn.

It models the numbers, not the schedule: the softmax is taken against the final maximum and p
rounded once, where the kernel takes it against a running maximum and G so far (a p rounded
against a smaller G keeps more bits, so the model is the pessimistic side of the kernel). It
prints the output's largest error over its largest value, and the lse's largest error, for each
case and each arithmetic: the GPU tests hold the kernel to 1e-2 on both.
"""

from __future__ import annotations

import torch

from benchmarks.lab.model_sm80_fp8_fragments import fp16_range_scale
from mla.kernels import fp8

C, R, N = 512, 64, 64  # latent, rope, tokens a tile


def tile_exponent(m: float) -> int | None:
    """The kernel's F for a tile whose largest scale is m (None: no valid row)."""
    if m == 0.0:
        return None
    e = int(torch.tensor(m, dtype=torch.float32).view(torch.int32).item() >> 23 & 0xFF) - 127
    return e - 5 if e > 5 else (max(e + 14, -60) if e < -14 else 0)


def rows_of(args, b):
    """Sequence b's stored rows (T, 656) in token order."""
    cache, table, n = args["kv_cache"], args["block_table"][b], int(args["seq_lens"][b])
    page = cache.shape[1]
    return torch.stack([cache[int(table[t // page]), t % page] for t in range(n)])


def attend(q, k, v, scale):
    """float64 attention of q (h, 576) over k (T, 576), v (T, 512); returns out (h, 512), lse (h,)."""
    s = (q @ k.T) * scale
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v, lse


def reference(q, rows, scale):
    values = torch.cat(fp8.dequantize_ds_mla(rows, C, R), dim=-1).double()  # (T, 576)
    return attend(q.double(), values, values[:, :C], scale)


def before_row_74(q, rows, scale):
    """Values e4m3 x scale rounded to bf16, q and p in bf16, sums in float."""
    values = torch.cat(fp8.dequantize_ds_mla(rows, C, R), dim=-1).to(torch.bfloat16).double()
    qd = q.to(torch.bfloat16).double()
    s = (qd @ values.T) * scale
    m = s.max(dim=-1, keepdim=True).values
    p = torch.exp(s - m)
    l = p.sum(dim=-1)
    out = p.to(torch.bfloat16).double() @ values[:, :C] / l[:, None]
    return out, m[:, 0] + torch.log(l)


def row_74(q, rows, scale):
    """dsfp16's rounding: fp16 latent values and q over powers of two, bf16 rope, fp16 p."""
    t = rows.shape[0]
    e4m3 = rows[:, :C].view(torch.float8_e4m3fn).to(torch.float16)  # exact
    scales = rows[:, C:C + 16].contiguous().view(torch.float32).double()  # (T, 4)
    rope = rows[:, C + 16:].contiguous().view(torch.bfloat16).double()  # (T, 64)
    top = q.abs().max().item()
    q_scale = fp16_range_scale(top)
    q_lat = (q[:, :C].double() * q_scale).to(torch.float16).double()
    q_rope = (q[:, C:].double() * q_scale).to(torch.bfloat16).double()
    s_parts, v_parts, fs = [], [], []
    for t0 in range(0, t, N):
        sl = slice(t0, min(t0 + N, t))
        f = tile_exponent(scales[sl].max().item())
        f = 0 if f is None else f
        down = 2.0 ** -f
        sc16 = (scales[sl] * down).to(torch.float16)  # (n, 4) the scale over 2^F, in fp16
        vals = (e4m3[sl].view(-1, 4, 128) * sc16[:, :, None]).reshape(-1, C).double()  # fp16 products
        rope_t = rope[sl] * down  # exact in bf16 for these F
        s = (q_lat @ vals.T + q_rope @ rope_t.T) * 2.0 ** f / q_scale
        s_parts.append(s)
        v_parts.append(vals)
        fs.append(f)
    s = torch.cat(s_parts, dim=1) * scale
    m = s.max(dim=-1, keepdim=True).values
    g = max(fs)
    out = torch.zeros(q.shape[0], C, dtype=torch.float64)
    l = torch.zeros(q.shape[0], dtype=torch.float64)
    for (t0, vals, f) in zip(range(0, t, N), v_parts, fs):
        p = torch.exp(s[:, t0:t0 + vals.shape[0]] - m)
        l += p.sum(dim=-1)
        out += (p * 2.0 ** (f - g)).to(torch.float16).double() @ vals
    return out * 2.0 ** g / l[:, None], m[:, 0] + torch.log(l)


def case(name, args):
    worst = {"before row 74": [0.0, 0.0], "row 74": [0.0, 0.0]}
    for b in range(args["q"].shape[0]):
        if int(args["seq_lens"][b]) == 0:
            continue
        rows, q = rows_of(args, b), args["q"][b]
        ref_out, ref_lse = reference(q, rows, args["softmax_scale"])
        for label, fn in (("before row 74", before_row_74), ("row 74", row_74)):
            out, lse = fn(q, rows, args["softmax_scale"])
            err = ((out - ref_out).abs().max() / ref_out.abs().max()).item()
            worst[label][0] = max(worst[label][0], err)
            worst[label][1] = max(worst[label][1], (lse - ref_lse).abs().max().item())
    print(f"{name:<34}" + "".join(f"  {label}: out {e:.1e}, lse {l:.1e}" for label, (e, l) in worst.items()))


def main():
    from tests.test_kernels_decode_fp8 import make_fp8_case

    lengths = [1, 63, 65, 129, 1000, 3000]
    args, _, _, _ = make_fp8_case("fp8_ds_mla", lengths, heads=16, c=C, r=R, block_size=64, seed=5,
                                  group_growth=2.0)
    args["q"] = args["q"].to(torch.bfloat16).float()
    case("the GPU tests' cache", args)
    for k in (30, -40):
        cache = args["kv_cache"].clone()
        cache[..., C:C + 16].view(torch.float32).mul_(2.0**k)
        if k < 0:
            cache[..., C + 16:].view(torch.bfloat16).mul_(2.0**k)
        case(f"values x 2^{k}", dict(args, kv_cache=cache, softmax_scale=args["softmax_scale"] * 2.0**-k))
    cache = args["kv_cache"].clone()
    grow = 2.0 ** (12 * (torch.arange(cache.shape[0]) % 3 - 1)).double()
    cache[..., C:C + 16].view(torch.float32).mul_(grow[:, None, None].float())
    rope = cache[..., C + 16:].view(torch.bfloat16)
    rope.copy_((rope.double() * grow[:, None, None]).to(torch.bfloat16))
    case("pages 2^-12, 1, 2^12 in turn", dict(args, kv_cache=cache, softmax_scale=args["softmax_scale"] * 2.0**-12))


if __name__ == "__main__":
    main()
