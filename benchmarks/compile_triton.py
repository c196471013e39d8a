"""Compile the Triton kernels for an NVIDIA GPU on a machine without one, through the product's
own wrappers, and report what ptxas says of each: registers, spills, shared memory.

The wrappers run on tensors of torch's "meta" device (shapes, dtypes and the byte offsets of
views, no data), with a stand-in Triton driver that names the target GPU and launches nothing.
So each launch compiles exactly what the wrapper would launch on a GPU of that architecture:
the same constexprs, the same tile configuration, the same 16-byte alignment specialisation
(a meta tensor's data_ptr is its byte offset). What this cannot see: a kernel's results, its
speed, and anything decided from a real device's properties (the SM count picks the split count
when none is given; every case here gives one).

    PYTHONPATH=. python benchmarks/compile_triton.py --out DIR [--arch 90] [--quick]

Run it with each Triton the kernels must support (the GPU machine's and CI's): it prints a
table and writes DIR/triton-compile-<triton version>-sm<arch>.json. A compile error is a row
with its error, and the script exits 1.
"""

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before triton's first import: compile, do not interpret

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

# H100 / H200 (sm_90): 227 KB of shared memory a block, 64K registers an SM, 255 a thread.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


class _Utils:
    """The driver utilities a compiled kernel asks for before its first launch."""

    def load_binary(self, name, cubin, shared, device):
        return None, None, 0, 0, 1024  # module, function, registers, spills, max threads

    def get_device_properties(self, device):
        return {"max_shared_mem": SHARED_LIMIT.get(self.arch, 232448), "multiprocessor_count": 132,
                "max_num_regs": 65536, "warpSize": 32}


class CompileOnlyDriver:
    """A Triton driver that targets `arch` and launches nothing."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)
        self.utils = _Utils()
        self.utils.arch = arch
        self.launched = set()  # id() of each launched kernel's metadata (a refused one never is)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("meta")

    def launcher_cls(self, src, metadata):
        launched = self.launched

        def launch(*args):
            launched.add(id(metadata))
        return launch


def parse_ptxas_log(log: str) -> dict:
    """Registers, spill bytes and stack frame from ptxas's -v report of one kernel."""
    def number(pattern):
        found = re.search(pattern, log)
        return int(found.group(1)) if found else None
    return {"registers": number(r"Used (\d+) registers"), "stack_frame_bytes": number(r"(\d+) bytes stack frame"),
            "spill_store_bytes": number(r"(\d+) bytes spill stores"),
            "spill_load_bytes": number(r"(\d+) bytes spill loads")}


def capture_ptxas_logs() -> dict:
    """Make every compile keep the log of Triton's own ptxas run (its flags differ between
    versions): returns a list of (compiled kernel, log), appended to as kernels compile."""
    import contextlib
    import io

    import triton.compiler
    from triton import knobs
    knobs.nvidia.dump_ptxas_log = True
    logs, compile_ = [], triton.compiler.compile

    def compile_keeping_log(*args, **kwargs):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            kernel = compile_(*args, **kwargs)
        logs.append((kernel, printed.getvalue()))
        return kernel
    triton.compiler.compile = compile_keeping_log  # the JIT binds it at its first launch
    return logs


def refused(kernel: dict, over: bool) -> str:
    """The table's note for a kernel over the shared-memory limit."""
    if not over:
        return ""
    return " > limit, launched" if kernel["launched"] else " > limit, refused (stepped down)"


def mma_kind(kernel: dict) -> str:
    """'wgmma', 'mma' (mma.sync, the pre-Hopper instruction) or '-' for a kernel without dots."""
    return "wgmma" if kernel["wgmma"] else "mma" if kernel["mma_sync"] else "-"


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def decode_cases(quick: bool):
    """mla_decode on DeepSeek-V3's latent (c 512, r 64), page 64: every cache layout, 16 and
    128 heads, one and four new tokens, one split and several."""
    c, r, page = 512, 64, 64
    from mla.kernels import fp8
    heads = [16, 128] if not quick else [16]
    for kind in fp8.LAYOUTS:
        for dtype in ([torch.bfloat16, torch.float16] if kind == "auto" and not quick else [torch.bfloat16]):
            for h in heads:
                for s_q in ([1, 4] if not quick else [1]):
                    for splits in ([1, 8] if not quick else [8]):
                        cache_dtype, width = fp8.cache_row(kind, c, r, dtype)
                        b, blocks = 4, 16
                        yield (f"decode {kind} {str(dtype)[6:]} h={h} s_q={s_q} splits={splits}",
                               dict(q=meta(b, s_q, h, c + r, dtype=dtype),
                                    kv_cache=meta(64, page, width, dtype=cache_dtype),
                                    block_table=meta(b, blocks, dtype=torch.int32),
                                    seq_lens=meta(b, dtype=torch.int32),
                                    kv_lora_rank=c, softmax_scale=0.1, num_kv_splits=splits,
                                    max_seq_len=blocks * page, check_block_table=False,
                                    kv_cache_dtype=kind, kv_scale=1.0 if kind == "fp8_e4m3" else None,
                                    _backend="triton"))


def prefill_cases(quick: bool):
    """mla_prefill at V3's up-projected head dims (d 128, r 64, v 128), 128 heads, causal
    prompts and new tokens over a context, short and long rows (the tile configuration
    depends on the longest row)."""
    h, d, r, v = 128, 128, 64, 128
    shapes = [(1024, 1024, True), (8192, 8192, True), (512, 4096, False)] if not quick else [(1024, 1024, True)]
    for dtype in ([torch.bfloat16, torch.float16] if not quick else [torch.bfloat16]):
        for s, t, causal in shapes:
            kv = meta(t, h, d + v, dtype=dtype)  # the layer's up-projection: k_nope and v are views
            latent = meta(t, 512 + r, dtype=dtype)  # [kv_c | k_pe] rows: k_pe is a view 1024 bytes in
            yield (f"prefill {str(dtype)[6:]} s={s} t={t} causal={causal}",
                   dict(q_nope=meta(s, h, d, dtype=dtype), q_pe=meta(s, h, r, dtype=dtype),
                        k_nope=kv[..., :d], k_pe=latent[:, 512:], v=kv[..., d:],
                        cu_seqlens_q=meta(2, dtype=torch.int32), cu_seqlens_k=meta(2, dtype=torch.int32),
                        max_seqlen_q=s, max_seqlen_k=t, softmax_scale=0.1, causal=causal))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    parser.add_argument("--quick", action="store_true", help="one case a kernel")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                        help="a decode _config override (BLOCK_N=32, num_warps=8, ...), repeatable")
    args = parser.parse_args()

    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-compile-"))  # compile, don't reuse
    stand_in = CompileOnlyDriver(args.arch)
    logs = capture_ptxas_logs()
    driver.set_active(stand_in)
    from mla.kernels import decode, prefill  # after the driver: the kernels bind to it

    rows, failed = [], False
    cases = [(n, decode.mla_decode, kw) for n, kw in decode_cases(args.quick)]
    cases += [(n, prefill.mla_prefill, kw) for n, kw in prefill_cases(args.quick)]
    cases = [case for case in cases if args.only in case[0]]
    overrides = {key: int(value) for key, value in (item.split("=") for item in args.config)}
    for name, fn, kwargs in cases:
        if overrides and name.startswith("decode"):
            kwargs["_config"] = overrides
        before = len(logs)
        start = time.perf_counter()
        try:
            fn(**kwargs)
            error = None
        except Exception as exc:  # a compile error is this script's finding
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            failed = True
        kernels = []
        for compiled, log in logs[before:]:  # the kernels this case compiled (not the ones reused)
            md = compiled.metadata
            ptx = compiled.asm["ptx"]
            kernels.append({"kernel": md.name, "num_warps": md.num_warps, "num_stages": md.num_stages,
                            "shared_bytes": md.shared, **parse_ptxas_log(log),
                            # False: over the GPU's shared memory, refused before launch (the
                            # wrapper then steps down to a smaller configuration)
                            "launched": id(md) in stand_in.launched,
                            # the tensor-core instruction Triton chose (wgmma needs 64 rows a
                            # warpgroup) and the asynchronous copies that pipeline the loads
                            "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
                            "mma_sync": len(re.findall(r"\bmma\.sync", ptx)),
                            "cp_async": len(re.findall(r"cp\.async\.(?:ca|cg)", ptx))})
        rows.append({"case": name, "config": overrides or None, "error": error,
                     "compile_s": round(time.perf_counter() - start, 2), "kernels": kernels})

    limit = SHARED_LIMIT.get(args.arch)
    result = {"triton": triton.__version__, "torch": torch.__version__, "arch": args.arch,
              "shared_limit": limit, "cases": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"triton-compile-{triton.__version__}-sm{args.arch}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")

    print(f"Triton {triton.__version__}, sm_{args.arch} (shared memory limit {limit} B)")
    print(f"  {'case':<46} {'kernel':<26} {'warps':>5} {'stages':>6} {'shared B':>9} {'regs':>5} {'spill st/ld B':>14}"
          f" {'mma':>6}")
    over_limit = False
    for row in rows:
        if row["error"]:
            print(f"  {row['case']:<46} {row['error']}")
        elif not row["kernels"]:
            print(f"  {row['case']:<46} (the kernels of a case above, compiled once)")
        for k in row["kernels"]:
            over = limit is not None and k["shared_bytes"] > limit
            over_limit |= over and k["launched"]
            print(f"  {row['case']:<46} {k['kernel'][:26]:<26} {k['num_warps']:>5} {k['num_stages']:>6} "
                  f"{k['shared_bytes']:>9} {k['registers']!s:>5} {k['spill_store_bytes']!s:>6}/"
                  f"{k['spill_load_bytes']!s:<7} {mma_kind(k):>6}{refused(k, over)}")
    print(f"wrote {path}")
    return 1 if failed or over_limit else 0


if __name__ == "__main__":
    sys.exit(main())
