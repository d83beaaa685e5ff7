"""Convert a Hugging Face Qwen2/Qwen2.5/Qwen3/Qwen3-MoE directory into a megatron dist checkpoint (torch_dist).

The output is the trainer's own format in Megatron-LM's ``--load`` layout (``latest_checkpointed_iteration.txt`` and
``release/``): ``offgrpo train model.init=megatron`` and Megatron-LM start from it at any TP/PP/EP, since loading
reshards. ``--tp/--pp/--ep`` only set how much each writing process holds: with all three 1 it runs in one process;
otherwise under ``torchrun --nproc_per_node TP*PP*EP``.

Usage: python -m checkpoint_tools.hf_to_megatron --hf DIR --out DIR [--tp T] [--pp P] [--ep E] [--overwrite]
"""

from __future__ import annotations

from checkpoint_tools._cli import Parser, parallel_size, run_cli
from checkpoint_tools._dist_write import hf_to_dist_dir


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", required=True, help="HF model directory (config.json + *.safetensors)")
    parser.add_argument("--out", required=True, help="output directory (written atomically)")
    parser.add_argument("--tp", type=parallel_size, default=1,
                        help="tensor-parallel size of the writing processes (divides heads, KV heads, vocab)")
    parser.add_argument("--pp", type=parallel_size, default=1,
                        help="pipeline-parallel size of the writing processes (divides the layer count)")
    parser.add_argument("--ep", type=parallel_size, default=1,
                        help="expert-parallel size of the writing processes (Qwen3-MoE: divides the expert count)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier output at --out")
    args = parser.parse_args(argv)
    run_cli(lambda: hf_to_dist_dir(args.hf, args.out, args.tp, args.pp, args.ep, args.overwrite))


if __name__ == "__main__":
    main()
