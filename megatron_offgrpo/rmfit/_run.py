"""``offgrpo rm``'s procedure, top to bottom: sample and label, check, build the classifier from the policy, train,
measure on the held-out prompts, write the directory and the report."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Sequence

from megatron_offgrpo.config import Config
from megatron_offgrpo.rmfit._metrics import score_report
from megatron_offgrpo.rmfit._samples import LabelledGroup, NoContrastError, check_contrast, sample_labelled

logger = logging.getLogger(__name__)

REPORT_FILE = "rm_report.json"
"""The report in ``train.out_dir``: counts, held-out and training metrics, the loss curve, scored examples."""
METRICS_FILE = "metrics.jsonl"
"""One line per step (``{"step": k, "rm_loss": ...}``): also what marks ``train.out_dir`` as holding a run."""
EXAMPLES = 4
"""Held-out completions written to the report with their ids, text and score (what a loaded model must give)."""


def _counts(groups: Sequence[LabelledGroup]) -> dict[str, int]:
    labels = [g.labels for g in groups]
    right = sum(map(sum, labels))
    return {"groups": len(groups), "samples": sum(map(len, labels)), "right": right,
            "wrong": sum(map(len, labels)) - right, "mixed_groups": sum(0 < sum(y) < len(y) for y in labels)}


def _measure(model, groups: Sequence[LabelledGroup], pad_id: int) -> tuple[dict, list[float]]:
    """(``score_report`` of the classifier on ``groups``, the scores in order)."""
    from megatron_offgrpo.rmfit._classifier import score_sequences

    scores = score_sequences(model, [s for g in groups for s in g.sequences], pad_id)
    labels = [y for g in groups for y in g.labels]
    group_ids = [i for i, g in enumerate(groups) for _ in g.responses]
    return score_report(scores, labels, group_ids), scores


def _line(name: str, metrics: dict) -> str:
    value = lambda key: "n/a" if metrics[key] is None else f"{metrics[key]:.3f}"  # noqa: E731
    return (f"{name}: accuracy {value('accuracy')} (majority class {value('majority_accuracy')}), AUC {value('auc')}, "
            f"within-group pairwise {value('group_pairwise_accuracy')}")


def _tokenizer(policy: Path):
    """The policy's tokenizer with its end-of-turn token as the pad token. HF's classifier reads the score at the last
    token that is not the pad id, so a completion is scored at its answer's last token whether or not the scorer's
    sequence ends with EOS; at EOS itself the score carried less to held-out questions on the demo (within-group
    accuracy 0.63 against 0.74, 3 seeds). The saved tokenizer pads with the same id as the config, so a scorer that
    pads with either reads the same token."""
    import copy

    from megatron_offgrpo.model import load_tokenizer

    tokenizer = copy.deepcopy(load_tokenizer(policy))  # the loaded one is shared (cached): not changed here
    if tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def fit_reward_model(config: Config) -> dict:
    """Fit the reward model of ``config`` (``rm.*``, with model.hf_path, data.*, rollout.*, train.*, optim.lr):
    writes ``train.out_dir/hf``, ``REPORT_FILE`` and ``METRICS_FILE``; returns the report.

    Raises:
        NoContrastError: the training completions are all right or all wrong (or, pairwise, no group is mixed).
    """
    from megatron_offgrpo.model import resolve_model_dir
    from megatron_offgrpo.rmfit import _classifier as clf

    start, out, rm = time.monotonic(), Path(config.train.out_dir), config.rm
    policy = resolve_model_dir(config.model.hf_path)
    train, heldout, data_report = sample_labelled(config, policy)
    check_contrast(train, config.model.hf_path)
    counts = {"train": _counts(train), "heldout": _counts(heldout)}
    if rm.loss == "pairwise" and not counts["train"]["mixed_groups"]:
        raise NoContrastError("rm.loss=pairwise: no training group holds both a right and a wrong completion; use "
                              "rm.loss=bce, or sample more per prompt (rollout.group_size)")
    logger.info("labelled: training %(right)d right, %(wrong)d wrong (%(mixed_groups)d of %(groups)d groups mixed)",
                counts["train"])
    logger.info("labelled: held out %(right)d right, %(wrong)d wrong (%(mixed_groups)d of %(groups)d groups mixed)",
                counts["heldout"])
    tokenizer = _tokenizer(policy)
    pad_id = tokenizer.pad_token_id
    model = clf.build_classifier(policy, pad_id, config.parallel.seed, rm.freeze_embeddings)
    before, _ = _measure(model, heldout, pad_id)
    out.mkdir(parents=True, exist_ok=True)
    t = config.train
    with open(out / METRICS_FILE, "w", encoding="utf-8") as metrics:
        def on_step(step: int, loss: float) -> None:
            metrics.write(json.dumps({"step": step, "rm_loss": loss}) + "\n")
            if step == 1 or step % t.log_every == 0 or step == t.steps:
                logger.info("[%5d/%d] rm %s loss %.4f", step, t.steps, rm.loss, loss)

        losses = clf.train_classifier(model, train, rm.loss, t.steps, config.optim.lr, config.optim.weight_decay,
                                      config.optim.clip_grad, rm.groups_per_step, config.parallel.seed, pad_id,
                                      on_step)
    held, scores = _measure(model, heldout, pad_id)
    trained, _ = _measure(model, train, pad_id)
    hf_dir = clf.save_classifier(model, tokenizer, out / "hf")
    sequences = [s for g in heldout for s in g.sequences]
    labels = [y for g in heldout for y in g.labels]
    report = {
        "model": str(hf_dir), "policy": config.model.hf_path, "loss": rm.loss, "steps": t.steps,
        "counts": counts, "heldout": held, "heldout_before": before, "train": trained, "loss_curve": losses,
        "examples": [{"ids": sequences[i], "text": tokenizer.decode(sequences[i]), "label": labels[i],
                      "score": scores[i]} for i in range(min(EXAMPLES, len(sequences)))],
        "data": data_report, "wall_s": round(time.monotonic() - start, 1)}
    (out / REPORT_FILE).write_text(json.dumps(report, indent=1))
    logger.info(_line("held out, before training", before))
    logger.info(_line("held out", held))
    logger.info(_line("training", trained))
    return report
