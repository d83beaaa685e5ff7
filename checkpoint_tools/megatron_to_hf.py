"""Convert a megatron checkpoint of any TP x PP layout into a Hugging Face directory.

``--ckpt`` is a megatron dist checkpoint of any TP x PP x DP layout (``hf_to_megatron``'s output or a trainer
checkpoint ``RUN/checkpoints/step_N``, resharded to TP1/PP1 in this one process), or a checkpoint_tools directory of
an earlier version (per-rank safetensors, ``megatron_meta.json``); the kind is detected from its files. Writes
sharded safetensors + index, config.json, generation_config.json and the tokenizer files; the result loads with
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``. A checkpoint of a LoRA run (its model
card lists the adapter) exports as the merged model (``--what merged``, the default: each adapted weight
``W + alpha/r B A``) or as the adapter alone (``--what adapter``: a PEFT directory, ``adapter_config.json`` and
``adapter_model.safetensors``, that ``peft.PeftModel.from_pretrained(base, DIR)`` loads onto the base model).

Usage: python -m checkpoint_tools.megatron_to_hf --ckpt DIR --out DIR [--what merged|adapter] [--base-model NAME]
       [--max-shard-size 2GB] [--overwrite]
"""

from __future__ import annotations

import argparse
import re

from checkpoint_tools._cli import Parser, run_cli
from checkpoint_tools._dist import megatron_to_hf_any

_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}


def parse_size(text: str) -> int:
    """'2GB' / '500MiB' / '1048576' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"--max-shard-size {text!r}: expected a size like 2GB, 500MiB or 1048576")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True,
                        help="megatron checkpoint directory: from hf_to_megatron, a trainer checkpoint "
                        "RUN/checkpoints/step_N, or an earlier version's checkpoint_tools directory")
    parser.add_argument("--out", required=True, help="output HF directory (written atomically)")
    parser.add_argument("--what", choices=("merged", "adapter"), default="merged",
                        help="merged: the HF model, any LoRA adapter merged in; adapter: the LoRA adapter alone, as "
                        "a PEFT directory")
    parser.add_argument("--base-model", default=None,
                        help="--what adapter: the base model's name or path, written as the adapter's "
                        "base_model_name_or_path")
    parser.add_argument("--max-shard-size", type=parse_size, default=parse_size("2GB"),
                        help="largest safetensors shard")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out if it exists (after the new one is complete)")
    args = parser.parse_args(argv)
    run_cli(lambda: megatron_to_hf_any(args.ckpt, args.out, args.max_shard_size, args.overwrite, args.what,
                                       args.base_model))


if __name__ == "__main__":
    main()
