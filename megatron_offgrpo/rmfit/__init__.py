"""Fitting a scalar reward model from the policy's own labelled samples (``offgrpo rm``): the policy samples groups
of completions through the run's engine (``sampler``), the rule reward labels each right or wrong, and a one-label
sequence classifier initialised from the policy learns to tell them apart, held-out prompts measuring it.

    report = fit_reward_model(config)   # writes train.out_dir/hf (AutoModelForSequenceClassification), rm_report.json

Inside: ``_losses`` (the pure losses: BCE, Bradley-Terry pairs within a group), ``_metrics`` (accuracy, AUC, the
within-group pairwise accuracy), ``_samples`` (labelled groups from the engine), ``_classifier`` (the classifier:
built from the policy, trained, scored, saved), ``_run`` (the procedure, top to bottom).

The door the command (``megatron_offgrpo.cli.rm``) and the tests enter by. Names load lazily: ``offgrpo rm --help``
must not import torch, and logging is set up before transformers is imported.
"""

from megatron_offgrpo._lazy import lazy_door

_EXPORTS = {
    "fit_reward_model": "megatron_offgrpo.rmfit._run",
    "NoContrastError": "megatron_offgrpo.rmfit._samples",
    "REPORT_FILE": "megatron_offgrpo.rmfit._run",
    "rm_loss": "megatron_offgrpo.rmfit._losses",
    "bce_loss": "megatron_offgrpo.rmfit._losses",
    "pairwise_loss": "megatron_offgrpo.rmfit._losses",
    "auc": "megatron_offgrpo.rmfit._metrics",
    "score_sequences": "megatron_offgrpo.rmfit._classifier",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_door(_EXPORTS)
