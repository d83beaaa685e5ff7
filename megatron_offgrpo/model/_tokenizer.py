"""A HF model directory's tokenizer: the one every command reads (the run, the data check, ``offgrpo eval``), and
the one check of it that ``train``, ``sft``, ``eval``, ``fleet start`` and ``convert hf-to-megatron`` share."""

from __future__ import annotations

import functools
from pathlib import Path

from megatron_offgrpo.model._arch import ASSETS, resolve_model_dir

PROBE = "What is 2 + 3?"
BUNDLED_TOKENIZER = ASSETS / "qwen2-tokenizer"  # Qwen2.5's, used for a directory without tokenizer_config.json


def load_tokenizer(hf_path: str | Path):
    """The model directory's tokenizer, or the bundled Qwen2.5 tokenizer when the directory has none (``hf_path``:
    anything ``resolve_model_dir`` accepts). Read once per process and directory: the data check before the run
    and the run itself share it."""
    return _tokenizer_of(resolve_model_dir(hf_path).resolve())


@functools.lru_cache(maxsize=4)
def _tokenizer_of(model_dir: Path):
    import transformers

    has_own = (model_dir / "tokenizer_config.json").exists()
    return transformers.AutoTokenizer.from_pretrained(model_dir if has_own else BUNDLED_TOKENIZER)


def tokenizer_errors(model_dir: Path, key: str, source: str | Path, policy: str | Path | None = None) -> list[str]:
    """The directory's own tokenizer (``tokenizer_config.json``; without one the bundled Qwen2.5 tokenizer is used)
    must load and encode ``PROBE`` to at least one token: one without ``vocab.json``/``merges.txt`` (or
    ``tokenizer.json``) encodes every prompt to nothing, which vLLM refuses much later as an empty prompt. ``key``
    and ``source`` name where the directory came from (``model.hf_path=DIR``, ``--hf DIR``). With ``policy`` (a model
    that scores the policy's token ids: a distillation teacher), it must also give the policy's (``policy``'s) tokens
    the same ids and cut text the same way (``_tokenizer_diff``: what is compared), the first difference named."""
    errors = _own_errors(Path(model_dir), key, source)
    if errors or policy is None:
        return errors
    from megatron_offgrpo.model._tokenizer_diff import tokenizer_difference

    difference = tokenizer_difference(resolve_model_dir(policy), Path(model_dir), load_tokenizer)
    if difference is None:
        return []
    return [f"{key}={source}: its tokenizer differs from the policy's (model.hf_path={policy}): {difference}; the "
            "model scores the policy's token ids, so it needs the policy's tokenizer (the same ids for the same "
            "tokens)"]


def _own_errors(model_dir: Path, key: str, source: str | Path) -> list[str]:
    if not (model_dir / "tokenizer_config.json").is_file():
        return []
    try:
        ids = load_tokenizer(str(model_dir)).encode(PROBE, add_special_tokens=False)
    except Exception as exc:  # transformers raises many kinds for a broken tokenizer
        return [f"{key}={source}: its tokenizer does not load ({type(exc).__name__}: "
                f"{next(iter(str(exc).splitlines()), '')}): give the directory a complete tokenizer "
                "(tokenizer.json, or vocab.json and merges.txt)"]
    if not ids:
        return [f"{key}={source}: its tokenizer encodes {PROBE!r} to no tokens (no vocab.json/merges.txt or "
                "tokenizer.json?): give the directory a complete tokenizer"]
    return []
