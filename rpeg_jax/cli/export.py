"""`rpeg export --run-dir runs/x [--step N] --out DIR [--overwrite]`: a run's trained policy as a
Hugging Face checkpoint directory (runtime/export.py: what is written, from where, and its errors);
`--adapter DIR` instead of --out: a model.lora run's adapters as a PEFT adapter directory.
Errors are one line, exit 2."""

from __future__ import annotations

import sys

from rpeg_jax.runtime.export import ExportError, export


def add_arguments(p) -> None:
    p.add_argument("--run-dir", required=True, help="the run's train.run_dir (holds config.yaml, checkpoints/)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="directory to write (must be empty or absent)")
    where.add_argument(
        "--adapter", metavar="DIR", help="model.lora runs: write the adapters as a PEFT adapter directory here"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")


def run(args) -> int:
    try:
        out = args.adapter or args.out
        step, files = export(args.run_dir, out, step=args.step, overwrite=args.overwrite, adapter=bool(args.adapter))
    except ExportError as e:
        print(f"rpeg export: {e}", file=sys.stderr)
        return 2
    print(f"rpeg export: step {step} of {args.run_dir} -> {out}: {', '.join(files)}")
    return 0
