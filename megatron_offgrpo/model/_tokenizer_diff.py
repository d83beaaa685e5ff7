"""Whether a distillation teacher reads the policy's token ids as the policy means them.

The teacher scores the policy's token ids, never text: a teacher whose tokenizer numbers the tokens otherwise (the
same vocabulary permuted, other added tokens) scores every sampled id as some other token, and nothing downstream
can tell (its log-probs are finite, ``teacher_kl`` looks like a KL). A vocabulary size says nothing about this, so
the tokenizers themselves are compared, once, before the run:

- checked: every entry of the policy's vocabulary, added and special tokens included (``get_vocab`` holds them), has
  the same id in the teacher's (a teacher may have more tokens after them, as Qwen3's beside Qwen2.5's: it is never
  asked about them); and the rules that cut text into those tokens (normalizer, pre-tokenizer, the model's kind and
  options, its BPE merges), as transformers builds them from each directory (a tokenizer class may fix some of them
  whatever ``tokenizer.json`` says: Qwen2's does its normalizer): a teacher that would cut the same text otherwise
  is scored on cuts it never saw.
- not checked: the chat template, which tokens count as special, the post-processor (what ``encode`` adds around a
  text) and the decoder: the teacher is given the policy's sequence as it is, and none of them changes a token's id.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from megatron_offgrpo.data import ASSETS

BUNDLED = ASSETS / "qwen2-tokenizer"  # what ``_tokenizer.load_tokenizer`` reads for a directory without a tokenizer


def tokenizer_source(model_dir: Path) -> Path:
    """The directory whose tokenizer ``load_tokenizer(model_dir)`` reads (the bundled Qwen2.5 one without its own)."""
    return model_dir.resolve() if (model_dir / "tokenizer_config.json").is_file() else BUNDLED.resolve()


def tokenizer_difference(policy_dir: Path, teacher_dir: Path, load: Callable[[str], Any]) -> str | None:
    """The first way the teacher's tokenizer (``teacher_dir``'s) gives the policy's (``policy_dir``'s) tokens other
    ids or cuts text otherwise, in words ("token 'abc' is id 17 in the policy, 912 in the teacher"), or None.
    ``load``: ``_tokenizer.load_tokenizer`` (passed in: that module calls this one)."""
    if tokenizer_source(policy_dir) == tokenizer_source(teacher_dir):
        return None  # one tokenizer
    policy, teacher = load(str(policy_dir)), load(str(teacher_dir))
    difference = _id_difference(policy, teacher.get_vocab()) or _rules_difference(policy, teacher)
    if difference is None:
        return None
    roles = (("policy", policy_dir), ("teacher", teacher_dir))
    bundled = [f"the {role} has no tokenizer of its own (the bundled Qwen2.5 one stands for it)"
               for role, path in roles if tokenizer_source(path) == BUNDLED]
    return difference + "".join(f"; {note}" for note in bundled)


def _id_difference(policy: Any, teacher: dict[str, int]) -> str | None:
    """The policy's lowest id whose token the teacher numbers otherwise (or lacks)."""
    for token, id_ in sorted(policy.get_vocab().items(), key=lambda item: item[1]):
        other = teacher.get(token)
        if other != id_:
            where = "absent from the teacher's vocabulary" if other is None else f"{other} in the teacher"
            text = policy.convert_tokens_to_string([token])  # byte-level 'Ġadd' is the text ' add'
            shown = repr(token) if text == token else f"{token!r} (text {text!r})"
            return f"token {shown} is id {id_} in the policy, {where}"
    return None


def _rules_difference(policy: Any, teacher: Any) -> str | None:
    """The first of normalizer, pre-tokenizer, model options and merges that differ (fast tokenizers' serialized
    parts, compared as bytes and parsed only where they differ: a whole tokenizer's JSON takes a second to parse; a
    slow tokenizer has none to compare, and its vocabulary was compared above)."""
    if not (hasattr(policy, "backend_tokenizer") and hasattr(teacher, "backend_tokenizer")):
        return None
    mine, theirs = policy.backend_tokenizer, teacher.backend_tokenizer
    for name in ("normalizer", "pre_tokenizer"):
        a, b = _state(getattr(mine, name)), _state(getattr(theirs, name))
        if a != b:
            return f"its {name} differs: {_short(a)} in the policy, {_short(b)} in the teacher"
    a, b = _state(mine.model), _state(theirs.model)  # the kind, options, vocabulary (compared above) and merges
    if a == b:
        return None
    a, b = json.loads(a), json.loads(b)
    for key in sorted((set(a) | set(b)) - {"vocab", "merges"}):
        if a.get(key) != b.get(key):
            x, y = (json.dumps(side.get(key), ensure_ascii=False) for side in (a, b))
            return f"its model.{key} differs: {_short(x)} in the policy, {_short(y)} in the teacher"
    a, b = a.get("merges") or [], b.get("merges") or []
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"its BPE merge #{k} differs: {_merge(x)!r} in the policy, {_merge(y)!r} in the teacher"
    if len(a) != len(b):
        return f"its BPE merges differ: {len(a)} in the policy, {len(b)} in the teacher"
    return None  # the model vocabularies alone differ, in ids no policy token has (compared above)


def _state(part: Any) -> str | None:
    """A tokenizers component as its JSON text (what ``tokenizer.json`` holds for it; None where there is none)."""
    return None if part is None else part.__getstate__().decode("utf-8")


def _merge(entry: Any) -> str:
    return " ".join(entry) if isinstance(entry, list) else str(entry)  # tokenizers writes pairs or "a b" strings


def _short(text: str | None) -> str:
    """JSON text, cut to a line's share."""
    text = str(text)
    return text if len(text) <= 120 else text[:117] + "..."
