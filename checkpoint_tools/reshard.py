"""Rewrite a megatron checkpoint in another TP x PP (x EP) layout (bit-exact).

Usage: python -m checkpoint_tools.reshard --ckpt DIR --out DIR --tp T --pp P [--ep E]
"""

from __future__ import annotations

from checkpoint_tools._cli import Parser, parallel_size, run_cli
from checkpoint_tools._convert import reshard_dir


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="source megatron checkpoint directory")
    parser.add_argument("--out", required=True, help="output directory (must not exist; written atomically)")
    parser.add_argument("--tp", type=parallel_size, required=True, help="target tensor-parallel size")
    parser.add_argument("--pp", type=parallel_size, required=True, help="target pipeline-parallel size")
    parser.add_argument("--ep", type=parallel_size, default=1,
                        help="target expert-parallel size (Qwen3-MoE: divides the expert count)")
    args = parser.parse_args(argv)
    run_cli(lambda: reshard_dir(args.ckpt, args.out, args.tp, args.pp, args.ep))


if __name__ == "__main__":
    main()
