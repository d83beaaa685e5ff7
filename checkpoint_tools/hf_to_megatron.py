"""Convert a Hugging Face Qwen2/Qwen2.5/Qwen3/Qwen3-MoE directory into a megatron TP x PP (x EP) checkpoint.

Usage: python -m checkpoint_tools.hf_to_megatron --hf DIR --out DIR [--tp T] [--pp P] [--ep E]
"""

from __future__ import annotations

from checkpoint_tools._cli import Parser, parallel_size, run_cli
from checkpoint_tools._convert import hf_to_megatron_dir


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", required=True, help="HF model directory (config.json + *.safetensors)")
    parser.add_argument("--out", required=True, help="output directory (must not exist; written atomically)")
    parser.add_argument("--tp", type=parallel_size, default=1,
                        help="tensor-parallel size (divides heads, KV heads, vocab)")
    parser.add_argument("--pp", type=parallel_size, default=1, help="pipeline-parallel size (divides the layer count)")
    parser.add_argument("--ep", type=parallel_size, default=1,
                        help="expert-parallel size (Qwen3-MoE: divides the expert count)")
    args = parser.parse_args(argv)
    run_cli(lambda: hf_to_megatron_dir(args.hf, args.out, args.tp, args.pp, args.ep))


if __name__ == "__main__":
    main()
