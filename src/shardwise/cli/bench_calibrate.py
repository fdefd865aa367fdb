"""``shardwise bench calibrate``: time the kernels the planner prices, on this device, for a
model's block, and write a kernel profile (JSON) ``shardwise plan --kernels-profile`` reads.

    shardwise bench calibrate --quick                       # CPU, gpt2-124m, fp32
    shardwise bench calibrate --device cuda --model llama3-8b --out h100.json
    shardwise plan --model llama3-8b --cluster dgx-h100 --gpus 8 --kernels-profile h100.json

Measures the block's GEMMs at a few micro-batches and tp sizes, SDPA attention forward and
backward per kernel and length, an element-wise op's bytes/s and the AdamW step per
parameter (``planner.kernel_bench``; the format: ``planner.kernels``). Collectives are not
re-measured: the profile names the comm profile in use, which ``shardwise bench comm
--calibrate`` measures. Bad input: one line naming the flag, exit 2, no file written.
"""

from __future__ import annotations

import argparse
import json
import sys

from shardwise.base.files import write_text
from shardwise.cli.common import EXIT_USAGE, Parser, output_path, parse_or_code

DEFAULT_MODEL = "gpt2-124m"
DEFAULT_OUT = "runs/bench_calibrate/kernels.json"


def build_parser() -> Parser:
    """The parser of ``shardwise bench calibrate``."""
    from shardwise.planner.kernel_bench import DTYPES

    p = Parser(prog="shardwise bench calibrate", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where to time the kernels (default cpu)")
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME|TOML",
                   help=f"a named size of shardwise plan or a TOML with a [model] table "
                        f"(default {DEFAULT_MODEL})")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="tensors' dtype (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="PATH",
                   help=f"the profile to write (default {DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repeats (a smoke run)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``shardwise bench calibrate``; returns the exit code (2: bad input)."""
    args = parse_or_code(build_parser(), argv)
    if isinstance(args, int):  # --help (0) or a one-line error (2)
        return args
    try:
        import torch

        from shardwise.planner.specs import load_model

        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device cuda: no CUDA GPU here (torch {torch.__version__})")
        try:
            spec = load_model(args.model)
        except ValueError as exc:  # the flag named once, whatever the spec loader says
            text = str(exc)
            raise ValueError(text if text.startswith("--model") else
                             f"--model {args.model}: {text}") from None
        out = output_path("--out", args.out)
    except ValueError as exc:  # SpecError among them
        print(f"shardwise bench calibrate: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from shardwise.planner.kernel_bench import measure

    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    prof = measure(spec, args.device, dtype, args.quick)
    try:
        write_text(out, json.dumps(prof, indent=1) + "\n", unique=True)  # never half of one
    except OSError as exc:
        print(f"shardwise bench calibrate: error: --out {args.out}: {exc.strerror}",
              file=sys.stderr)
        return EXIT_USAGE
    best = max(prof["gemm"], key=lambda r: r["flops_per_s"])
    eff = f", {best['efficiency']:.0%} of the datasheet peak" if best["efficiency"] else ""
    print(f"{prof['device']} ({prof['dtype']}, torch {prof['torch']}): {len(prof['gemm'])} "
          f"GEMMs, best {best['flops_per_s'] / 1e12:.3g} TFLOP/s{eff}; "
          f"{len(prof['attention'])} attention rows "
          f"({', '.join(sorted({r['kernel'] for r in prof['attention']}))}); "
          f"AdamW {prof['optimizer']['seconds_per_param'] * 1e9:.3g} ns/param")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
