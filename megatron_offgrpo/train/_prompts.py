"""The run's tokenizer and prompts, as the engine sees them (the training stream, the eval set, ``offgrpo eval``)."""

from __future__ import annotations

from megatron_offgrpo.config import Config
from megatron_offgrpo.data import ASSETS, Prompt, build_prompt, load_records
from megatron_offgrpo.model import resolve_model_dir


def load_tokenizer(hf_path: str):
    """The model directory's tokenizer, or the bundled Qwen2.5 tokenizer when the directory has none (``hf_path``:
    anything ``resolve_model_dir`` accepts)."""
    import transformers

    model_dir = resolve_model_dir(hf_path)
    has_own = (model_dir / "tokenizer_config.json").exists()
    return transformers.AutoTokenizer.from_pretrained(model_dir if has_own else ASSETS / "qwen2-tokenizer")


def load_prompts(config: Config, tokenizer, split: str) -> list[Prompt]:
    """The prompts of ``split`` of the recipe's dataset, built as the engine sees them."""
    d = config.data
    records = load_records(d.name, split, d.source, d.path, question_key=d.question_key, answer_key=d.answer_key,
                           count=d.count, seed=config.parallel.seed, max_operand=d.max_operand)
    return [build_prompt(r, tokenizer, d.system_prompt, d.instruction, d.max_prompt_tokens, d.prompt_format)
            for r in records]
