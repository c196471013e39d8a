"""The command line: `python -m mla demo | memory | generate | bench ...` (or `mla ...` once installed).

    demo    a random-weight layer of a preset; ragged prompts, prefill then decode steps through
            each tier (the paged tier also on each fp8 cache); error against the naive tier,
            cache bytes per token, time per decode step; --tp N splits the heads over N
            processes (mla.parallel)
    memory  KV cache per token and per sequence for MHA, GQA-8, MQA and MLA (also its fp8 layouts
            and its up-projected keys and values), and the paper's claims
    generate  transformers' generate() on a small random DeepSeek-V3-shaped model (or --model DIR)
            with its own attention and with each tier swapped in (mla.hf): same tokens?
            tokens a second, attention FLOPs and transient memory of a decode step
    bench   the GPU benchmarks in benchmarks/ (decode, concat, layer, prefill, tp, generate);
            `bench WHICH --help` shows that benchmark's options
"""

from __future__ import annotations

import argparse
import json
import math
import runpy
import sys
import threading
import time
from pathlib import Path

import torch

from . import memory, parallel
from .config import PRESETS, MLAConfig
from .kernels import fp8
from .tiers import TIERS, build
from .weights import MLAWeights

# The dtypes every tier runs in: the paged tier's kernels take these three (not float64).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The error an fp8 cache is held to against the naive tier: half an e4m3 step, relative
# (docs/derivations/fp8-cache.md).
FP8_TOLERANCE = 2.0**-4


def _table(header: list[str], rows: list[list], title: str | None = None) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [title] if title else []
    out += [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- demo ----------------------------------------------------------------------------------
def demo(args: argparse.Namespace, *, rank: int = 0, world_size: int = 1, group=None) -> dict:
    """The demo; under `--tp` (`demo_tp`) every rank runs it with its shard of the heads.

    Rank 0 prints, and also runs the unsharded naive tier to measure the sharded tiers against.
    """
    from tqdm import tqdm

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    config = MLAConfig.from_preset(args.preset)
    tiers = args.tiers.split(",")
    for tier in tiers:
        if tier not in TIERS:
            raise SystemExit(f"--tiers: unknown tier {tier!r}; expected some of {list(TIERS)}")
    if "naive" not in tiers:
        tiers = ["naive", *tiers]  # the reference every other tier is measured against
    # the paged tier once per cache layout: "paged", "paged/fp8_e4m3", "paged/fp8_ds_mla"
    skipped = []
    if "paged" in tiers:
        at = tiers.index("paged")
        fp8_kinds = list(args.kv_cache_dtype)
        if not fp8.fp8_available():
            skipped, fp8_kinds = [(k, "this torch has no float8_e4m3fn") for k in fp8_kinds], []
        elif config.kv_lora_rank % fp8.DS_MLA_GROUP and "fp8_ds_mla" in fp8_kinds:
            fp8_kinds.remove("fp8_ds_mla")
            skipped.append(("fp8_ds_mla", f"needs a latent width c that is a multiple of "
                                          f"{fp8.DS_MLA_GROUP}, this preset's is "
                                          f"{config.kv_lora_rank}"))
        tiers[at + 1:at + 1] = [f"paged/{k}" for k in fp8_kinds]

    weights = MLAWeights(config, dtype=dtype, device=device, seed=args.seed).requires_grad_(False)
    shard = weights if world_size == 1 else weights.shard(rank, world_size)
    layers = {}
    for name in tiers:
        tier, _, kind = name.partition("/")
        options = dict(kv_cache_dtype=kind) if kind else {}
        layers[name] = build(shard, tier, process_group=group, **options)
    if world_size > 1 and rank == 0:
        layers["unsharded"] = build(weights, "naive")
    max_len = args.prompt_len + args.decode_steps
    caches = {tier: layer.new_cache(args.batch, max_len) for tier, layer in layers.items()}
    gen = torch.Generator().manual_seed(args.seed)
    # Ragged prompts: row i holds prompt_len·(1 - i/(2·batch)) tokens, right-padded.
    lengths = torch.tensor([max(1, round(args.prompt_len * (1 - i / (2 * args.batch))))
                            for i in range(args.batch)])
    prompt = torch.randn(args.batch, args.prompt_len, config.hidden_size, generator=gen)
    steps = [torch.randn(args.batch, 1, config.hidden_size, generator=gen)
             for _ in range(args.decode_steps)]

    errors = {tier: [] for tier in tiers}  # rel err against naive, one a call
    tp_errors = []  # of the sharded tiers against the unsharded naive tier
    decode_time = {tier: 0.0 for tier in tiers}
    prefill_time = {tier: 0.0 for tier in tiers}

    def run(tier, x, lens, cache=None):
        _sync(device)
        start = time.perf_counter()
        y = layers[tier](x.to(device, dtype), caches[tier] if cache is None else cache, lens)
        _sync(device)
        return y.float(), time.perf_counter() - start

    def compare(outputs, x, lens):
        """Each tier's output against naive's and, under --tp, against the unsharded layer's."""
        for tier in tiers:
            errors[tier].append(_rel(outputs[tier], outputs["naive"]))
        if "unsharded" in layers:
            reference, _ = run("unsharded", x, lens)
            tp_errors.extend(_rel(outputs[tier], reference) for tier in tiers if "/" not in tier)

    total = len(tiers) * (2 + args.decode_steps)
    with torch.inference_mode(), tqdm(total=total, desc="demo", leave=False,
                                      disable=not args.progress or rank != 0) as bar:
        # Warm-up: a tier's first prefill and first decode step compile its kernels (seconds on
        # a first run), which is not what the table reports. One untimed prefill and step each,
        # on a scratch cache; every rank makes the same calls, so the collectives match.
        for tier in tiers:
            scratch = layers[tier].new_cache(args.batch, max_len)
            run(tier, prompt, lengths, scratch)
            if steps:
                run(tier, steps[0], None, scratch)
            del scratch
            bar.update()
        outputs = {}
        for tier in tiers:
            outputs[tier], prefill_time[tier] = run(tier, prompt, lengths)
            bar.update()
        compare(outputs, prompt, lengths)
        for x in steps:
            step_out = {}
            for tier in tiers:
                step_out[tier], seconds = run(tier, x, None)
                decode_time[tier] += seconds
                bar.update()
            compare(step_out, x, None)
    tp_error = _worst(tp_errors) if tp_errors else 0.0

    element = torch.tensor([], dtype=dtype).element_size()
    mha_bytes = memory.cache_elements_per_token(config, "mha") * element
    rows = []
    for name in tiers:
        tier, _, kind = name.partition("/")
        per_step = decode_time[name] / max(1, args.decode_steps)
        kind = kind or "auto"
        rows.append(dict(tier=tier, kv_cache_dtype=kind,
                         max_rel_err_vs_naive=_worst(errors[name]),
                         kv_bytes_per_token_layer=int(memory.latent_cache_bytes_per_token(
                             config, kind, element)),
                         mha_bytes_per_token_layer=mha_bytes,
                         prefill_ms=prefill_time[name] * 1e3, decode_ms_per_step=per_step * 1e3))
    result = dict(preset=args.preset, device=str(device), dtype=str(dtype).replace("torch.", ""),
                  batch=args.batch, prompt_lengths=lengths.tolist(),
                  decode_steps=args.decode_steps, tiers=rows,
                  skipped_kv_cache_dtypes=dict(skipped))
    if world_size > 1:
        result.update(tp=world_size, tp_max_rel_err_vs_unsharded_naive=tp_error)
    if rank != 0:
        return result

    print(f"mla demo: {args.preset} (hidden {config.hidden_size}, {config.num_heads} heads, "
          f"latent {config.kv_lora_rank}+{config.qk_rope_head_dim}), {result['dtype']} on "
          f"{device}, batch {args.batch}, prompts {lengths.tolist()}, "
          f"{args.decode_steps} decode steps")
    print(_table(
        ["tier", "cache", "max rel err vs naive", "KV bytes/token/layer", "MHA would cache",
         "prefill ms", "decode ms/step"],
        [[r["tier"], result["dtype"] if r["kv_cache_dtype"] == "auto" else r["kv_cache_dtype"],
          f"{r['max_rel_err_vs_naive']:.2e}", r["kv_bytes_per_token_layer"],
          r["mha_bytes_per_token_layer"], f"{r['prefill_ms']:.1f}",
          f"{r['decode_ms_per_step']:.2f}"] for r in rows]))
    for kind, why in skipped:
        print(f"paged tier on an {kind} cache skipped: {why}")
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    # NaN < tolerance is False: an error of NaN never agrees
    exact = [r for r in rows if r["kv_cache_dtype"] == "auto"]
    agree = all(r["max_rel_err_vs_naive"] < tolerance for r in exact)
    print(f"tiers agree with naive within {tolerance:g}: {'yes' if agree else 'NO'}")
    fp8_rows = [r for r in rows if r["kv_cache_dtype"] != "auto"]
    if fp8_rows:
        fp8_agree = all(r["max_rel_err_vs_naive"] < FP8_TOLERANCE for r in fp8_rows)
        print(f"fp8 caches within {FP8_TOLERANCE:g} of naive (half an e4m3 step): "
              f"{'yes' if fp8_agree else 'NO'}")
        agree = agree and fp8_agree
    if world_size > 1:
        tp_agree = tp_error < tolerance
        print(f"tensor parallel over {world_size} ranks ({config.num_heads // world_size} heads "
              f"a rank): max rel err of the sharded tiers vs the unsharded naive tier "
              f"{tp_error:.2e} ({'within' if tp_agree else 'NOT within'} {tolerance:g})")
        agree = agree and tp_agree
    result["agree"] = agree
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if not agree and world_size == 1:
        raise SystemExit(1)  # under --tp the launching process exits, once
    return result


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _worst(errors: list[float]) -> float:
    """The largest error, or NaN if any is NaN (`max(0.0, nan)` is 0.0: max drops a NaN)."""
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def demo_tp(args: argparse.Namespace) -> dict:
    """`demo --tp N`: the demo on N ranks (`mla.parallel.launch`), each with 1/N of the heads.

    Every rank builds the full weights from the same seed, keeps its shard and runs the same
    prompts and decode steps; rank 0 prints the table and the error against the unsharded naive
    tier. Returns rank 0's figures.
    """
    heads = MLAConfig.from_preset(args.preset).num_heads
    if heads % args.tp:
        raise SystemExit(f"--tp {args.tp}: the {heads} heads of {args.preset} do not split evenly "
                         "over that many ranks")
    cuda = torch.device(args.device).type == "cuda"
    if cuda and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"--tp {args.tp} with --device cuda needs {args.tp} GPUs, one a rank; "
                         f"{torch.cuda.device_count()} visible")
    return parallel.launch(_demo_rank, args.tp, args, backend="nccl" if cuda else "gloo")[0]


def _demo_rank(rank: int, world_size: int, group, args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    # tqdm's default lock holds a multiprocessing semaphore, which a rank (it leaves with
    # os._exit) would leak; a thread lock serves the one process
    tqdm.set_lock(threading.RLock())
    if torch.device(args.device).type == "cuda":
        args.device = f"cuda:{rank}"
    return demo(args, rank=rank, world_size=world_size, group=group)


# ---- memory --------------------------------------------------------------------------------
def memory_report(args: argparse.Namespace) -> None:
    config = MLAConfig.from_preset(args.preset)
    layers = memory.NUM_LAYERS[args.preset]
    rows = memory.kv_cache_table(config, args.seq_len, layers)
    mla_row = next(r for r in rows if r["scheme"] == "mla")
    print(f"KV cache of {args.preset}: {layers} layers, {config.num_heads} heads, head dim "
          f"{config.v_head_dim}, bf16, sequences of {args.seq_len} tokens")
    print(_table(
        ["scheme", "elements/token/layer", "bytes/token/layer", "KiB/token", "MiB/sequence",
         "vs MLA"],
        [[r["scheme"], r["elements_per_token_layer"], f"{r['bytes_per_token'] / layers:g}",
          f"{r['bytes_per_token'] / 1024:.1f}", f"{r['bytes_per_sequence'] / 2**20:.1f}",
          f"{r['bytes_per_token'] / mla_row['bytes_per_token']:.2f}x"] for r in rows]))
    print(f"MLA caches as much as GQA with {memory.mla_equivalent_gqa_groups(config):g} groups "
          f"(paper: 2.25 for V2)")
    print(f"DeepSeek-V2 vs DeepSeek 67B KV cache: {memory.paper_kv_reduction_vs_67b():.1%} smaller "
          f"with V2's cache at 6 bits an element (paper: 93.3%); "
          f"{memory.paper_kv_reduction_vs_67b(16):.1%} with both in bf16")


# ---- generate ------------------------------------------------------------------------------
def generate_report(args: argparse.Namespace) -> dict:
    """transformers' generate() with its own attention, then with each tier swapped in."""
    import transformers
    from tqdm import tqdm

    from . import hf

    tiers = args.tiers.split(",")
    for tier in tiers:
        if tier not in TIERS:
            raise SystemExit(f"--tiers: unknown tier {tier!r}; expected some of {list(TIERS)}")
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.model, dtype=dtype, attn_implementation="eager").to(device).eval()
        name = args.model
    else:
        model = hf.random_model(MLAConfig.from_preset("tiny"), num_layers=2, vocab_size=256,
                                dtype=dtype, device=device, seed=args.seed)
        name = "random DeepSeek-V3-shaped model (tiny preset attention, 2 layers, MoE)"
    config = MLAConfig.from_hf(model.config)
    num_layers = model.config.num_hidden_layers

    # Ragged prompts, left-padded as transformers expects: row i holds
    # prompt_len·(1 - i/(2·batch)) random tokens.
    gen = torch.Generator().manual_seed(args.seed)
    lengths = [max(1, round(args.prompt_len * (1 - i / (2 * args.batch))))
               for i in range(args.batch)]
    s = max(lengths)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, s), generator=gen)
    mask = (torch.arange(s)[None, :] >= s - torch.tensor(lengths)[:, None]).long()
    batch = dict(input_ids=ids.masked_fill(mask == 0, 0).to(device), attention_mask=mask.to(device))

    class Progress(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            bar.update()
            return scores

    kinds = ["transformers", *tiers]
    rows, reference = [], None
    options = {"paged": {"num_kv_splits": 1}} if device.type == "cpu" else {}
    with torch.inference_mode(), tqdm(total=len(kinds) * args.max_new_tokens, desc="generate",
                                      leave=False, disable=not args.progress) as bar:
        for kind in kinds:
            if kind != "transformers":
                hf.swap_attention(model, kind, **options.get(kind, {}))
            _sync(device)
            start = time.perf_counter()
            out = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 pad_token_id=0, logits_processor=[Progress()])
            _sync(device)
            seconds = time.perf_counter() - start
            if kind != "transformers":
                hf.swap_back(model)
            if reference is None:
                reference = out
            final = [n + out.shape[1] - s for n in lengths]      # tokens a row at the end
            costs = [hf.decode_step_costs(config, t, dtype.itemsize)[kind] for t in final]
            rows.append(dict(
                implementation=kind, same_tokens=bool(torch.equal(out, reference)),
                tokens_per_s=args.batch * (out.shape[1] - s) / seconds,
                decode_step_attention_gflops=num_layers * sum(c["flops"] for c in costs) / 1e9,
                decode_step_transient_mib=max(c["transient_bytes"] for c in costs)
                * args.batch / 2**20))
    result = dict(model=name, device=str(device), dtype=str(dtype).replace("torch.", ""),
                  prompt_lengths=lengths, max_new_tokens=args.max_new_tokens, rows=rows)
    print(f"mla generate: {name}, {result['dtype']} on {device}, prompts {lengths} "
          f"(left-padded), {args.max_new_tokens} new tokens, greedy")
    print(_table(
        ["attention", "same tokens as transformers", "tokens/s", "decode step GFLOPs",
         "decode step transient MiB"],
        [[r["implementation"], "yes" if r["same_tokens"] else "NO", f"{r['tokens_per_s']:.1f}",
          f"{r['decode_step_attention_gflops']:.4g}", f"{r['decode_step_transient_mib']:.4g}"]
         for r in rows]))
    print("GFLOPs: attention beyond the shared projections, the whole batch, all layers, one "
          "decode step at the final lengths; transient: the step's largest per-layer "
          "intermediates (mla.hf.decode_step_costs)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if not all(r["same_tokens"] for r in rows):
        raise SystemExit(1)
    return result


# ---- bench ---------------------------------------------------------------------------------
BENCHES = ("decode", "concat", "layer", "prefill", "tp", "generate")
# The benchmarks refused up front without a GPU; bench_tp.py also runs over gloo, and says itself
# how many GPUs --device cuda needs.
GPU_ONLY = ("decode", "concat", "layer", "prefill", "generate")


def bench(which: str, options: list[str]) -> None:
    """Run benchmarks/bench_WHICH.py with `options` as its command line."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / f"bench_{which}.py"
    if not script.is_file():
        raise SystemExit(f"{script} not found: run from a checkout of the repository")
    wants_help = any(o in ("-h", "--help") for o in options)
    if which in GPU_ONLY and not wants_help and not torch.cuda.is_available():
        raise SystemExit(f"bench {which}: needs a CUDA GPU, and torch sees none")
    argv = sys.argv
    sys.argv = [str(script), *options]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv


# ---- the command line ----------------------------------------------------------------------
def _at_least(low: int):
    """An argparse type: an int >= low (argparse names the option in its error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _cache_dtypes(text: str) -> list[str]:
    """The paged tier's fp8 layouts to run besides "auto", canonical and once each."""
    kinds = []
    for kind in text.split(","):
        try:
            kind = fp8.canonical_kv_cache_dtype(kind)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected some of {', '.join(fp8.LAYOUTS)} (fp8 = fp8_e4m3), comma-separated, "
                f"got {text!r}") from None
        if kind != "auto" and kind not in kinds:
            kinds.append(kind)
    return kinds


def _device(text: str) -> str:
    """An argparse type: cpu, cuda or cuda:N."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def _check_gpu(args: argparse.Namespace) -> None:
    """`demo|generate --device cuda[:N]` on a machine without that GPU: say so, before any work."""
    device = torch.device(args.device)
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise SystemExit(f"{args.command} --device {args.device}: needs a CUDA GPU, and torch sees none "
                         "(leave --device out to run on the CPU)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise SystemExit(f"{args.command} --device {args.device}: "
                         f"{torch.cuda.device_count()} GPUs visible")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mla", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    # the options demo and generate share: which tiers, where, in what dtype, and the output
    run = argparse.ArgumentParser(add_help=False)
    run.add_argument("--tiers", default=",".join(TIERS),
                     help="comma-separated, e.g. naive,absorbed; the reference runs as well: "
                          "demo always runs the naive tier, generate transformers' own attention")
    run.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N")
    run.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                     help="default float32 on the CPU, bfloat16 on a GPU")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--json", default=None, help="write the figures to this file")
    run.add_argument("--no-progress", dest="progress", action="store_false")

    p = sub.add_parser("demo", parents=[run], help="run every tier on a random layer and compare")
    p.add_argument("--preset", default="deepseek-v2-lite", choices=sorted(PRESETS))
    p.add_argument("--batch", type=_at_least(1), default=4)
    p.add_argument("--prompt-len", type=_at_least(1), default=48)
    p.add_argument("--decode-steps", type=_at_least(0), default=8)
    p.add_argument("--tp", type=_at_least(1), default=1,
                   help="tensor parallel ranks, heads split over them (gloo on the CPU; with "
                        "--device cuda NCCL, one GPU a rank)")
    p.add_argument("--kv-cache-dtype", type=_cache_dtypes, default=",".join(fp8.LAYOUTS),
                   help="the paged tier's cache layouts, comma-separated: auto (the weights' "
                        "dtype, always run), fp8_e4m3 (or fp8), fp8_ds_mla; each fp8 one adds "
                        "a paged row")

    p = sub.add_parser("memory", help="KV cache per token and per sequence by attention scheme")
    p.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
    p.add_argument("--seq-len", type=_at_least(1), default=32768)

    p = sub.add_parser("generate", parents=[run],
                       help="transformers' generate() with each tier swapped in")
    p.add_argument("--model", default=None, help="a save_pretrained directory of a DeepseekV2/V3 "
                   "model (default: a small random DeepSeek-V3-shaped one)")
    p.add_argument("--batch", type=_at_least(1), default=3)
    p.add_argument("--prompt-len", type=_at_least(1), default=24)
    p.add_argument("--max-new-tokens", type=_at_least(1), default=24)

    p = sub.add_parser("bench", help="GPU benchmarks (benchmarks/bench_*.py)",
                       description="Runs benchmarks/bench_WHICH.py with the options that follow; "
                                   "`bench WHICH --help` lists them.")
    p.add_argument("which", choices=BENCHES)
    p.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options")

    args = parser.parse_args(argv)
    if args.command == "demo":
        _check_gpu(args)
        if args.tp > 1:
            if not demo_tp(args)["agree"]:
                raise SystemExit(1)
        else:
            demo(args)
    elif args.command == "memory":
        memory_report(args)
    elif args.command == "generate":
        _check_gpu(args)
        generate_report(args)
    else:
        bench(args.which, args.options)

