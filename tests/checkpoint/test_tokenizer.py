"""The real Qwen2.5 tokenizer shipped in the package loads offline and round-trips text, chat and special tokens."""

from __future__ import annotations

import transformers

from tests.helpers import TOKENIZER_DIR


def test_qwen_tokenizer_round_trips():
    tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    assert len(tok) == 151665  # 151643 BPE tokens + 22 added special tokens
    text = "Natalia sold clips to 48 of her friends in April. #### 72\n  unicode: été, 数学, ∑"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645 and tok.eos_token == "<|im_end|>"
    chat = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n") and "<|im_start|>user\n2+2?<|im_end|>" in chat
