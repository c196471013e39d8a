"""transformers' generate() on a DeepSeek-V3-wide model: its own attention against the tiers swapped in.

    PYTHONPATH=. python3 benchmarks/bench_generate.py --out benchmarks/results   # an H200
    python -m mla bench generate --out benchmarks/results                      # the same

The model: transformers' DeepseekV3ForCausalLM with `--layers` (2) layers at DeepSeek-V3's full
width (MLAConfig.from_preset("deepseek-v3"): hidden 7168, 128 heads, c 512, q 1536), dense MLP
layers (intermediate 18432), a 32768-token vocabulary, random weights (mla.hf.random_model), bf16.

Contenders: transformers' attention with attn_implementation "eager" and "sdpa" (the latent is
cached, then up-projected over the whole context every step), and `mla.hf.swap_attention`'s
"absorbed" and "paged" tiers. For each contender and batch (`--batches`, 1 and 32), prompts of
`--prompt-len` (4096) random tokens, greedy, `--new-tokens` (128) new tokens (eos off), the
prompt prefilled in chunks of `--prefill-chunk` (256) tokens so that prefill's transient memory
stays small beside the cache. Measured: the whole generate() call, prefill (up to the first
token) and decode (the other new tokens) apart, tokens a second, and the peak memory of each
phase (torch.cuda.max_memory_allocated, weights included).

Then the largest batch each contender decodes at `--long-context` (32768) tokens within
`--budget-gib` (120) GiB: estimated by `per_sequence_bytes` (cache of every layer plus the
largest transient a decode step holds for one layer), and verified by a probe that fills the
caches straight (random latents, no prefill: prefill at 32k has its own, larger, transient) and
runs `--probe-steps` decode steps under torch.cuda.set_per_process_memory_fraction(budget).
A probe that runs out of memory steps the batch down by 10% until one fits.

Prints a table and writes `generate.json` into `--out`. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import torch
from transformers import LogitsProcessor

CONTENDERS = ("eager", "sdpa", "absorbed", "paged")
GiB = 2**30


# ---- the memory model (CPU-importable; tests/test_hf.py checks it) -------------------------
def per_sequence_bytes(config, contender: str, t: int, num_layers: int,
                       element: int = 2, block_size: int = 64) -> dict[str, int]:
    """Bytes one sequence of t tokens holds while a decode step runs: `cache` (all layers) and
    `transient` (the largest of one layer's step; layers run one after another).

    Every contender caches the latent, c + r values a token a layer (transformers' DynamicCache
    too); the paged tier rounds up to whole pages. A step's transient:
        eager / sdpa  kv_b_proj's output t·h·(d+v), the keys copied with the rope part
                      t·h·(d+r), the cache's torch.cat (a second copy of the layer's latent),
                      scores h·t (float32; eager keeps a bf16 copy of the probabilities too)
        absorbed      the cached latent cast to float32 for the scores, t·(c+r)·4, and scores
                      and probabilities h·t·4 each
        paged         the split-KV partials, h·c·4 a split (up to 64 splits)
    """
    h, d, r, v, c = (config.num_heads, config.qk_nope_head_dim, config.qk_rope_head_dim,
                     config.v_head_dim, config.kv_lora_rank)
    tokens = math.ceil(t / block_size) * block_size if contender == "paged" else t
    cache = num_layers * tokens * (c + r) * element
    if contender in ("eager", "sdpa"):
        transient = (t * h * (d + v) * element + t * h * (d + r) * element
                     + t * (c + r) * element + h * t * 4
                     + (h * t * element if contender == "eager" else 0))
    elif contender == "absorbed":
        transient = t * (c + r) * 4 + 2 * h * t * 4
    elif contender == "paged":
        transient = 64 * h * c * 4
    else:
        raise ValueError(f"unknown contender {contender!r}; expected one of {CONTENDERS}")
    return dict(cache=cache, transient=transient)


def estimate_max_batch(config, contender: str, t: int, num_layers: int, budget_bytes: int,
                       fixed_bytes: int, vocab_size: int, element: int = 2) -> int:
    """The largest batch whose caches and one step's transient fit in budget_bytes beside
    fixed_bytes (weights, allocator slack); logits (b, vocab) float32 counted a sequence."""
    per = per_sequence_bytes(config, contender, t, num_layers, element)
    per_sequence = per["cache"] + per["transient"] + vocab_size * 4
    return max(0, (budget_bytes - fixed_bytes) // per_sequence)


# ---- the GPU parts -----------------------------------------------------------------------
def build_model(layers: int, vocab_size: int, device: str):
    import mla
    from mla import hf

    config = mla.MLAConfig.from_preset("deepseek-v3")
    model = hf.random_model(config, num_layers=layers, vocab_size=vocab_size,
                            intermediate_size=18432, moe=False, dtype=torch.bfloat16,
                            device=device, attn_implementation="sdpa", seed=0)
    return model, config


def use(model, contender: str, paged_options: dict):
    """Put `contender` in the model: transformers' attention of that name, or a tier."""
    from mla import hf

    if hf.swapped_tier(model) is not None:
        hf.swap_back(model)
    if contender in ("eager", "sdpa"):
        model.set_attn_implementation(contender)
    else:
        model.set_attn_implementation("sdpa")  # the mask's format; the tier ignores the rest
        hf.swap_attention(model, contender, **(paged_options if contender == "paged" else {}))


class _PhaseClock(LogitsProcessor):
    """A logits processor: the first call marks the end of prefill (time and peak memory)."""

    def __init__(self):
        self.prefill_s = None
        self.prefill_peak = None
        self.start = None

    def __call__(self, input_ids, scores):
        if self.prefill_s is None:
            torch.cuda.synchronize()
            self.prefill_s = time.perf_counter() - self.start
            self.prefill_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        return scores


def run_generate(model, b: int, prompt_len: int, new_tokens: int, chunk: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (b, prompt_len), generator=gen)
    ids = ids.to(model.device)
    clock = _PhaseClock()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    clock.start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=0, prefill_chunk_size=chunk, logits_processor=[clock])
    torch.cuda.synchronize()
    total = time.perf_counter() - clock.start
    decode_s = total - clock.prefill_s
    return dict(b=b, prompt_len=prompt_len, new_tokens=out.shape[1] - prompt_len,
                total_s=total, prefill_s=clock.prefill_s, decode_s=decode_s,
                tokens_per_s=b * new_tokens / total,
                decode_tokens_per_s=b * (new_tokens - 1) / decode_s,
                prefill_peak_gib=clock.prefill_peak / GiB,
                decode_peak_gib=torch.cuda.max_memory_allocated() / GiB,
                tokens=out[:, prompt_len:].cpu())


def _filled_cache(model, contender: str, b: int, t: int):
    """A cache as if b sequences of t tokens had been prefilled: random latents, no prefill."""
    from transformers import DynamicCache

    from mla import hf

    dev, dt = model.device, model.dtype
    cfg = model.config
    c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if contender in ("eager", "sdpa"):
        cache = DynamicCache(config=cfg)
        for layer in range(cfg.num_hidden_layers):
            cache.update(torch.randn(b, 1, t, c, device=dev, dtype=dt),
                         torch.randn(b, 1, t, r, device=dev, dtype=dt), layer)
        return cache
    cache = hf.MLACache(model)
    for layer in cache.layers:
        attn = layer.attn
        room = t + 64
        latent = (attn.new_cache(b, room) if contender == "absorbed"
                  else attn.new_cache(b, room, num_blocks=b * math.ceil(room / attn.block_size)))
        if contender == "paged":
            latent.allocate(torch.arange(b), torch.full((b,), t))
            latent.kv_cache.normal_()
        else:
            latent.kv_c.normal_()
            latent.k_pe.normal_()
        latent.seq_lens[:] = t
        layer.latent, layer.seen = latent, t
    return cache


def probe(model, contender: str, b: int, t: int, steps: int) -> dict:
    """`steps` decode steps of b sequences over t cached tokens; peak memory, or OOM."""
    cache = None
    try:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        cache = _filled_cache(model, contender, b, t)
        token = torch.full((b, 1), 5, device=model.device)
        with torch.no_grad():
            for step in range(steps):
                mask = torch.ones(b, t + step + 1, dtype=torch.long, device=model.device)
                pos = torch.full((b, 1), t + step, device=model.device)
                # past_key_values: the name every transformers version takes (later ones also
                # take `cache`); a name the model does not know would leave it a fresh, empty cache
                model(input_ids=token, attention_mask=mask, position_ids=pos, past_key_values=cache,
                      use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        return dict(b=b, fits=True, peak_gib=torch.cuda.max_memory_allocated() / GiB)
    except torch.cuda.OutOfMemoryError:
        return dict(b=b, fits=False, peak_gib=None)
    finally:
        del cache
        torch.cuda.empty_cache()


def largest_batch(model, config, contender: str, t: int, budget_gib: float, steps: int,
                  weights_bytes: int) -> dict:
    budget = int(budget_gib * GiB)
    estimate = estimate_max_batch(config, contender, t, model.config.num_hidden_layers, budget,
                                  fixed_bytes=weights_bytes + GiB,
                                  vocab_size=model.config.vocab_size)
    tried = []
    b = estimate
    while b > 0:
        result = probe(model, contender, b, t, steps)
        tried.append(result)
        if result["fits"]:
            break
        b = int(b * 0.9)
    verified = next((p for p in tried if p["fits"]), None)
    return dict(contender=contender, t=t, estimate=estimate,
                verified=verified["b"] if verified else 0,
                verified_peak_gib=verified["peak_gib"] if verified else None, probes=tried)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=32768)
    ap.add_argument("--long-context", type=int, default=32768)
    ap.add_argument("--budget-gib", type=float, default=120.0)
    ap.add_argument("--probe-steps", type=int, default=3)
    ap.add_argument("--no-probe", dest="probe", action="store_false")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_generate needs a CUDA GPU")
    contenders = args.contenders.split(",")
    for name in contenders:
        if name not in CONTENDERS:
            raise SystemExit(f"--contenders: unknown {name!r}; expected some of {CONTENDERS}")
    os.makedirs(args.out, exist_ok=True)
    started = time.time()

    model, config = build_model(args.layers, args.vocab_size, "cuda")
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    paged_options = dict(block_size=64)
    rows, reference = [], {}
    for contender in contenders:
        use(model, contender, paged_options)
        for b in (int(x) for x in args.batches.split(",")):
            try:
                with torch.no_grad():
                    row = run_generate(model, b, args.prompt_len, args.new_tokens,
                                       args.prefill_chunk, seed=b)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                rows.append(dict(contender=contender, b=b, oom=True))
                print(f"{contender:>8} b={b:<3} out of memory")
                continue
            tokens = row.pop("tokens")
            # Against the first contender that ran at this batch (eager, unless it ran out of
            # memory). bf16 sums in another order may flip a near tie, and every later token
            # of that row with it: the share of agreeing tokens, not a yes/no.
            ref_name, ref = reference.setdefault(b, (contender, tokens))
            row.update(contender=contender, oom=False, reference=ref_name,
                       tokens_equal_reference=float((tokens == ref).float().mean()))
            rows.append(row)
            print(f"{contender:>8} b={b:<3} {row['tokens_per_s']:9.1f} tok/s "
                  f"(decode {row['decode_tokens_per_s']:9.1f}), peak prefill "
                  f"{row['prefill_peak_gib']:.1f} / decode {row['decode_peak_gib']:.1f} GiB")

    capacity = []
    if args.probe:
        for contender in contenders:
            use(model, contender, paged_options)
            fraction = min(1.0, args.budget_gib * GiB
                           / torch.cuda.get_device_properties(0).total_memory)
            torch.cuda.set_per_process_memory_fraction(fraction)
            capacity.append(largest_batch(model, config, contender, args.long_context,
                                          args.budget_gib, args.probe_steps, weights_bytes))
            torch.cuda.set_per_process_memory_fraction(1.0)
            c = capacity[-1]
            print(f"{contender:>8} at {args.long_context} tokens in {args.budget_gib:g} GiB: "
                  f"estimate b={c['estimate']}, verified b={c['verified']}")

    header = ["contender", "b", "tokens/s", "decode tokens/s", "prefill peak GiB",
              "decode peak GiB", "tokens = reference"]
    lines = [header]
    for r in rows:
        if r["oom"]:
            lines.append([r["contender"], r["b"], "OOM", "", "", "", ""])
        else:
            lines.append([r["contender"], r["b"], f"{r['tokens_per_s']:.1f}",
                          f"{r['decode_tokens_per_s']:.1f}", f"{r['prefill_peak_gib']:.1f}",
                          f"{r['decode_peak_gib']:.1f}",
                          f"{r['tokens_equal_reference']:.0%} ({r['reference']})"])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))
    for c in capacity:
        print(f"largest batch at {c['t']} tokens, {args.budget_gib:g} GiB: {c['contender']}: "
              f"estimate {c['estimate']}, verified {c['verified']} "
              f"(peak {c['verified_peak_gib'] or 0:.1f} GiB)")

    import transformers

    result = dict(device=torch.cuda.get_device_name(0), host=platform.node(),
                  torch=torch.__version__, transformers=transformers.__version__, args=vars(args),
                  weights_gib=weights_bytes / GiB, rows=rows, capacity=capacity,
                  wall_s=time.time() - started)
    path = os.path.join(args.out, "generate.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
