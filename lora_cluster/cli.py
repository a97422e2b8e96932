"""The `lora-cluster` command line.

Each subcommand is one `_add_<name>(subparsers)` function that declares its arguments and sets
`handler` to a `_run_<name>(args) -> int` function; add a new subcommand by writing that pair and
listing the `_add_` function in `SUBCOMMANDS`. Handlers import what they need lazily, so `--help`
stays fast. `main` returns the exit status (0 on success).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from lora_cluster import __version__


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="write the demo model zoo (random-weight Llama model + LoRA adapters) offline",
        description="Write, deterministically from a seed, a small random-weight Llama model and N PEFT "
        "LoRA adapters. Rerunning with the same arguments is a no-op.",
    )
    p.add_argument("--out", type=Path, required=True, help="folder to write the zoo into")
    p.add_argument("--num-adapters", type=int, default=64, help="number of adapters a0..a{N-1} (default 64)")
    p.add_argument("--size", choices=["tiny", "base"], default="tiny", help="tiny (~0.1M) or base (~88M)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    p.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from lora_cluster.demo import build_demo_zoo

    if args.num_adapters < 0:
        print("lora-cluster demo: --num-adapters must be >= 0", file=sys.stderr)
        return 2
    try:
        zoo = build_demo_zoo(args.out, num_adapters=args.num_adapters, size=args.size, seed=args.seed)
    except FileExistsError as e:
        print(f"lora-cluster demo: {e}", file=sys.stderr)
        return 1
    print(f"model: {zoo.model_dir}")
    print(f"adapters: {zoo.adapters_dir} ({len(zoo.adapter_ids)} adapters)")
    return 0


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_demo]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand of `SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(prog="lora-cluster", description="Serve many LoRA adapters on one model")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lora-cluster` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
