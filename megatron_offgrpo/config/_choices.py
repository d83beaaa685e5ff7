"""The values of every choice key, one ``Literal`` type each: a field's type is its one list of values (coercion,
validation and docs/config.md read it from the type; there is no side table to forget)."""

from typing import Literal

ModelInit = Literal["hf", "random", "megatron"]
Precision = Literal["fp32", "bf16", "fp8"]
Fp8Recipe = Literal["delayed", "tensorwise", "blockwise"]
CompileMode = Literal["default", "reduce-overhead"]
DataSource = Literal["auto", "local", "hub"]
PromptFormat = Literal["chat", "plain"]
EngineKind = Literal["auto", "fleet", "vllm", "transformers"]
EngineDtype = Literal["auto", "float32", "bfloat16"]
TransportKind = Literal["disk", "collective", "shm"]
SyncKind = Literal["full", "delta"]
DeltaCompression = Literal["none", "zlib"]
BehaviorLogprobs = Literal["fleet", "recompute"]
RolloutMode = Literal["lockstep", "overlap", "async", "async_partial"]
KlEstimator = Literal["k1", "k2", "k3"]
TisLevel = Literal["token", "sequence"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "token_sum_norm"]
AdvantageForm = Literal["sqrt_var", "std_eps"]
RecWeight = Literal["none", "is"]
RecClip = Literal["none", "one_side", "two_side", "ring"]
Logger = Literal["tensorboard", "wandb", "mlflow"]
LoraTarget = Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
LoraSync = Literal["adapter", "merged"]
RewardNormalize = Literal["none", "group"]
UnparsedVerdict = Literal["zero", "resample"]
RmLoss = Literal["bce", "pairwise"]

RENAMED = {
    "rollout.overlap": "rollout.mode=overlap (overlap=false: the default, mode=lockstep)",
    "rollout.partial_rollouts": "rollout.mode=async_partial (partial_rollouts=false: mode=async)",
}
"""Keys folded into another key -> their new spelling: refused with this one line instead of the unknown key's list
of valid keys, so that an old recipe or command says what to write now. (Three keys, mode, overlap and
partial_rollouts, encoded one choice with two cross-field rules between them; ``rollout.mode`` is that choice.)"""
