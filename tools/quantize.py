"""`ggraph quantize`: llama.cpp's llama-quantize. Writes a GGUF in another file type, with
llama.cpp's per-tensor mix, byte for byte the file llama-quantize writes from the same input:

    ggraph quantize IN.gguf OUT.gguf Q4_K_M [--imatrix imatrix.gguf] [--dry-run] [-t N]
    ggraph quantize IN.gguf OUT.gguf F32        # a float copy (dequantizes any type ggraph reads)

File types: F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q2_K_S Q3_K_S Q3_K_M Q3_K_L Q4_K_S
Q4_K_M Q5_K_S Q5_K_M Q6_K IQ4_NL IQ4_XS (Q3_K, Q4_K, Q5_K: the _M mixes), by name or
llama.cpp's number. Requantizing an already quantized tensor needs --allow-requantize, as in
llama-quantize; converting one to F32/F16/BF16 does not. Progress is one line per tensor, as
llama-quantize prints it; the summary gives the sizes per type.
"""
from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="write a GGUF in another quantization (llama-quantize)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="the GGUF to read (a path or a model name)")
    p.add_argument("output", nargs="?", help="the GGUF to write (not with --dry-run)")
    p.add_argument("type", help="the file type: Q4_K_M, Q8_0, IQ4_XS, F16, ... or its number")
    p.add_argument("threads", nargs="?", type=int, help="threads (as -t)")
    p.add_argument("--imatrix", metavar="FILE",
                   help="importance matrix (llama-imatrix's GGUF or legacy .dat file)")
    p.add_argument("--include-weights", action="append", default=[], metavar="NAME",
                   help="use the imatrix only for tensors whose name contains NAME")
    p.add_argument("--exclude-weights", action="append", default=[], metavar="NAME",
                   help="do not use the imatrix for tensors whose name contains NAME")
    p.add_argument("--output-tensor-type", metavar="TYPE", help="type of output.weight")
    p.add_argument("--token-embedding-type", metavar="TYPE", help="type of token_embd.weight")
    p.add_argument("--tensor-type", action="append", default=[], metavar="PATTERN=TYPE",
                   help="type of the tensors whose name matches PATTERN (a regular "
                        "expression); may be repeated, the first match wins")
    p.add_argument("--pure", action="store_true",
                   help="no k-quant mix: every quantized tensor gets the file type's type")
    p.add_argument("--allow-requantize", action="store_true",
                   help="allow quantizing tensors that are quantized already")
    p.add_argument("--leave-output-tensor", action="store_true",
                   help="leave output.weight as it is")
    p.add_argument("--dry-run", action="store_true",
                   help="print the per-tensor and per-type sizes and the file size; write "
                        "nothing")
    p.add_argument("-t", "--threads-n", dest="threads_n", type=int, default=0,
                   help="threads (default: all cores)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ggraph.graphs.gguf.fetch import resolve_model
    from ggraph.graphs.quantize.imatrix_file import load_imatrix_for_quantize
    from ggraph.graphs.quantize.mix import MixOptions, parse_ftype, parse_tensor_type, parse_type
    from ggraph.graphs.quantize.quantize import QuantizeOptions, describe, quantize_model

    output, ftype_text, threads = args.output, args.type, args.threads
    if output is None and not args.dry_run:
        raise ValueError("give the output file (IN OUT TYPE), or --dry-run")
    if args.include_weights and args.exclude_weights:
        raise ValueError("--include-weights and --exclude-weights cannot be used together")
    src = resolve_model(args.input)
    mix = MixOptions(
        ftype=parse_ftype(ftype_text),
        output_tensor_type=args.output_tensor_type and parse_type(
            args.output_tensor_type, "--output-tensor-type"),
        token_embedding_type=args.token_embedding_type and parse_type(
            args.token_embedding_type, "--token-embedding-type"),
        tensor_types=tuple(parse_tensor_type(t) for t in args.tensor_type),
        pure=args.pure, leave_output_tensor=args.leave_output_tensor)
    im = None
    if args.imatrix:
        im = load_imatrix_for_quantize(args.imatrix, args.include_weights, args.exclude_weights)
        print(f"quantize: loaded {len(im.values)} importance matrix entries from "
              f"{args.imatrix} computed on {im.chunk_count} chunks", file=sys.stderr)
    opts = QuantizeOptions(mix, im or None, args.allow_requantize, args.dry_run,
                           threads or args.threads_n)
    if output is not None and not args.dry_run:
        print(f"quantize: {src} -> {output} as {mix.ftype}", file=sys.stderr)
    report = quantize_model(src, None if args.dry_run else output, opts,
                            say=lambda s: print(s, file=sys.stderr, flush=True))
    for line in describe(report):
        print(line)
    return 0
