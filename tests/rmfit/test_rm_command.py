"""``offgrpo rm`` end to end on a tiny budget: the real command samples a policy through the transformers engine,
labels, fits and writes a directory that ``AutoModelForSequenceClassification`` loads and that scores as the fitter
reported; its one-line refusals (a missing policy, a policy never right, bad keys)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import make_hf_model, tiny_hf_config

REPO = Path(__file__).resolve().parents[2]
RECIPE = "configs/tiny-cpu-rm.yaml"
EOS = 151645
# a, b <= 4: 20 training questions (sums 0..8), 5 held out; 12 of them sampled 8 times, a few steps
TINY = ["data.max_operand=4", "data.count=200", "rm.prompts=12", "train.eval_prompts=5", "rollout.group_size=8",
        "rollout.prompts_per_step=12", "rollout.engine=transformers", "train.steps=6", "train.log_every=3"]


def answering_model(directory: Path, answers: list[str], seed: int = 0) -> Path:
    """A random Qwen2 of the real vocabulary that answers every prompt with one of the single tokens ``answers``
    (about evenly) and then ends its turn: a policy that is sometimes right, in a second, without training.

    Every embedding row is one direction d1 (the answers' rows another, d2, orthogonal to it) plus small noise, and
    the layers' output projections are zero, so each position's final state is nearly its own token's direction.
    The answers' output rows point along the state after any prompt token, EOS's along the state after an answer."""
    from transformers import AutoTokenizer

    from megatron_offgrpo.data import ASSETS

    ids = AutoTokenizer.from_pretrained(ASSETS / "qwen2-tokenizer").convert_tokens_to_ids(answers)
    cfg = dict(tiny_hf_config(layers=1), vocab_size=151936, hidden_size=128, num_attention_heads=2,
               num_key_value_heads=2, max_position_embeddings=512, bos_token_id=151643, eos_token_id=EOS)
    model = make_hf_model(cfg, seed)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        generator = torch.Generator().manual_seed(seed)
        d1, d2 = torch.randn(2, emb.shape[1], generator=generator)
        d2 -= (d2 @ d1) / (d1 @ d1) * d1
        emb.copy_(d1 + 0.05 * torch.randn(emb.shape, generator=generator))
        emb[ids] = d2 + 0.05 * torch.randn(len(ids), emb.shape[1], generator=generator)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        after_prompt, after_answer = model.model.norm(torch.stack([d1, d2]))
        head = model.lm_head.weight
        head[ids] = after_prompt / after_prompt.norm() ** 2 * 30.0  # logit 30: the other 151,936 sum to about 12
        head[EOS] = after_answer / after_answer.norm() ** 2 * 30.0
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def digit_policy(tmp_path_factory) -> Path:
    """Answers a single digit 0..8: right about one time in nine on a + b with a, b <= 4."""
    return answering_model(tmp_path_factory.mktemp("policy") / "hf", [str(d) for d in range(9)])


def offgrpo_rm(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "megatron_offgrpo.cli", "rm", "--config", RECIPE, *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_rm_writes_a_classifier_that_scores_as_the_fitter_reported(digit_policy, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "rm"
    done = offgrpo_rm(*TINY, f"model.hf_path={digit_policy}", f"train.out_dir={out}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"reward model: {out / 'hf'}"
    assert "[    6/6] rm pairwise loss" in done.stderr and "held out: accuracy" in done.stderr, done.stderr
    report = json.loads((out / "rm_report.json").read_text())
    counts = report["counts"]
    assert counts["train"]["samples"] == 12 * 8 and counts["heldout"]["samples"] == 5 * 8, counts
    assert counts["train"]["right"] + counts["train"]["wrong"] == 96 and 0 < counts["train"]["right"] < 96
    assert len(report["loss_curve"]) == 6 and all(v > 0 for v in report["loss_curve"])
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == list(range(1, 7))
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and len(config["id2label"]) == 1
    # the pad id is the end of turn: the score is read at the answer's last token, with or without EOS after it
    assert config["pad_token_id"] == EOS and (out / "hf" / "model.safetensors").is_file()

    model = AutoModelForSequenceClassification.from_pretrained(out / "hf").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "hf")
    assert model.config.num_labels == 1 and len(report["examples"]) == 4 and tokenizer.pad_token_id == EOS
    for example in report["examples"]:
        ids = tokenizer(example["text"], add_special_tokens=False).input_ids  # the text reads back as the ids scored
        assert ids == example["ids"], example
        with torch.no_grad():
            logit = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
        assert logit == pytest.approx(example["score"], abs=1e-4), example
        assert ids[-1] == EOS  # the digit policy always ends its turn
        with torch.no_grad():  # and without it (a scorer that drops EOS), or padded: the same score
            cut = model(input_ids=torch.tensor([ids[:-1]])).logits[0, 0].item()
            padded = model(input_ids=torch.tensor([ids + [EOS] * 3]), attention_mask=torch.tensor(
                [[1] * len(ids) + [0] * 3])).logits[0, 0].item()
        assert cut == pytest.approx(logit, abs=1e-5) and padded == pytest.approx(logit, abs=1e-5)


@pytest.mark.slow
def test_a_policy_never_right_is_refused_in_one_line(tmp_path):
    policy = answering_model(tmp_path / "hf", ["x", "y"])  # no number: math_exact gives 0 to every completion
    done = offgrpo_rm(*TINY, "rm.prompts=2", "train.eval_prompts=1", f"model.hf_path={policy}",
                      f"train.out_dir={tmp_path / 'rm'}")
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: all 16 training completions of ") and "are wrong (data.reward)" in last, last
    assert "Traceback" not in done.stderr and not (tmp_path / "rm" / "hf").exists()


def test_a_missing_policy_names_offgrpo_sft(tmp_path, capsys):
    from megatron_offgrpo.cli.rm import main

    with pytest.raises(SystemExit) as caught:
        main(["--config", str(REPO / RECIPE), f"model.hf_path={tmp_path / 'sft' / 'hf'}",
              f"train.out_dir={tmp_path / 'rm'}"])
    err = capsys.readouterr().err.strip()
    assert caught.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: model.hf_path={tmp_path / 'sft' / 'hf'}: no such directory") and "offgrpo sft" in err


@pytest.mark.parametrize("override, expected", [
    ("rm.loss=hinge", "rm.loss='hinge': expected one of ['bce', 'pairwise']"),
    ("rm.groups_per_step=0", "rm.groups_per_step=0: must be >= 1"),
    ("rm.prompts=0", "rm.prompts=0: must be >= 1"),
    ("model.init=random", "model.init=random: offgrpo rm builds the classifier from the policy's weights"),
])
def test_bad_keys_are_refused_naming_them(override, expected, digit_policy, tmp_path, capsys):
    from megatron_offgrpo.cli.rm import main

    with pytest.raises(SystemExit) as caught:
        main(["--config", str(REPO / RECIPE), f"model.hf_path={digit_policy}", f"train.out_dir={tmp_path / 'rm'}",
              override])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and expected in err, err
    assert not (tmp_path / "rm").exists()


def test_training_is_deterministic(digit_policy):
    """Two fits from the same seed: the same losses, bit for bit (seeded head, batches, deterministic kernels)."""
    from megatron_offgrpo.rmfit._classifier import build_classifier, train_classifier
    from megatron_offgrpo.rmfit._samples import LabelledGroup

    groups = [LabelledGroup(f"p{i}", (785, 374, 220, 18 + i), [[16 + i, EOS], [17 + i, EOS], [18, EOS]],
                            [1.0, 0.0, 0.0]) for i in range(3)]

    def fit() -> list[float]:
        model = build_classifier(digit_policy, 151643, seed=7, freeze_embeddings=True)
        return train_classifier(model, groups, "pairwise", 3, 1e-3, 0.0, 1.0, 2, 7, 151643, lambda s, v: None)

    first = fit()
    assert first == fit() and len(first) == 3
