"""What the decode probes that time ``mla_decode`` beside FlashMLA share: their arguments
(shapes, new tokens a sequence, where to write) and, on the GPU, whether FlashMLA imports and
how many SMs there are."""

from __future__ import annotations

import argparse

from benchmarks.bench_decode import flashmla_status, parse_query_lengths, parse_shapes


def decode_probe_parser(doc: str, shapes: list[tuple[int, int, int]],
                        seconds: float | None = None) -> argparse.ArgumentParser:
    """--shapes (default ``shapes``), --s-q (default 1,2,4), --out and, where ``seconds`` is
    given, --seconds a window; described by ``doc``'s first line."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    named = ",".join("x".join(map(str, shape)) for shape in shapes)
    parser.add_argument("--shapes", type=parse_shapes, default=shapes, help=f"BxTxH,... (default {named})")
    parser.add_argument("--s-q", dest="s_q", type=parse_query_lengths, default=[1, 2, 4],
                        help="new tokens a sequence, comma-separated (default 1,2,4)")
    if seconds is not None:
        parser.add_argument("--seconds", type=float, default=seconds,
                            help=f"each window's length (default {seconds:g})")
    parser.add_argument("--out", default="benchmarks/lab/results")
    return parser


def flashmla_and_sms() -> tuple[bool, int]:
    """Whether FlashMLA's decode imports (printed with why), and the GPU's SM count."""
    import torch

    ok, why = flashmla_status()
    print(f"FlashMLA: {why}", flush=True)
    return ok, torch.cuda.get_device_properties(0).multi_processor_count
