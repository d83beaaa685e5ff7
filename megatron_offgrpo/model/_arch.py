"""A Hugging Face Qwen config, read into the typed architecture megatron-core is built from.

One job: decide whether a HF ``config.json`` describes a model we can represent exactly, and say which field is
not when it is not. Qwen2/Qwen2.5 (GQA, qkv bias, SwiGLU, RMSNorm, rope theta, tied or untied embeddings),
Qwen3 (q/k RMSNorm over head_dim, no qkv bias by default, explicit head_dim) and Qwen3-MoE (Qwen3 attention, every
layer a mixture of SwiGLU experts behind a softmax top-k router, no shared expert). ``resolve_model_dir`` finds that
config (and the weights beside it) for a ``model.hf_path``: a directory, a bundled asset or a hub id.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
ASSETS = Path(__file__).resolve().parents[1] / "assets"
ASSET_PREFIX = ("megatron_offgrpo", "assets")  # how recipes name bundled files: relative to the repository root
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]  # config, weights, tokenizer; no READMEs or .bin


class UnsupportedConfigError(ValueError):
    """A HF config field has a value this megatron model cannot represent."""


@dataclasses.dataclass(frozen=True)
class QwenArch:
    """The shape and flavour of a Qwen decoder, independent of any parallel layout.

    Attributes:
        model_type: "qwen2" or "qwen3".
        vocab_size: rows of the embedding and output layer (V).
        hidden_size: H. intermediate_size: SwiGLU inner size. num_layers: decoder layers.
        num_heads: query heads. num_kv_heads: key/value heads (GQA groups). head_dim: per-head size.
        rms_norm_eps: RMSNorm epsilon. rope_theta: rotary base. max_position_embeddings: longest sequence.
        tie_word_embeddings: output layer shares the embedding matrix.
        qkv_bias: q/k/v projections carry a bias (Qwen2 yes, Qwen3 no).
        qk_norm: RMSNorm on each query and key head (Qwen3).
        initializer_range: std of the normal init (for randomly initialised models).
        num_experts: routed experts per layer (0: a dense model). moe_top_k: experts per token.
        moe_intermediate_size: each expert's SwiGLU inner size. norm_topk_prob: the top-k probabilities are
            renormalised to sum to 1 (softmax over the chosen logits). router_aux_loss_coef: the load-balancing loss
            weight of the HF config (the trainer's default for ``model.moe_aux_loss_coef``).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    initializer_range: float = 0.02
    num_experts: int = 0
    moe_top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0

    @property
    def is_moe(self) -> bool:
        """Every decoder layer's MLP is a mixture of experts."""
        return self.num_experts > 0

    @property
    def hf_architecture(self) -> str:
        """The ``architectures[0]`` of the HF config this arch writes."""
        return SUPPORTED_MODEL_TYPES[self.model_type]

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = (h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0)
                + (2 * self.head_dim if self.qk_norm else 0))
        mlp = (self.num_experts * (3 * h * self.moe_intermediate_size + h) if self.is_moe
               else 3 * h * self.intermediate_size)
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    def check_layout(self, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
        """Raise ``ValueError`` naming the field and the fix when this arch cannot be split as tp x pp (x ep, with
        experts split etp ways: default tp)."""
        etp = tp if etp is None else etp
        errors = []
        for name, value in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads)):
            if value % tp:
                errors.append(f"{name}={value} is not divisible by tp={tp}: choose tp among the divisors of {value}")
        if self.vocab_size % tp:
            errors.append(f"vocab_size={self.vocab_size} is not divisible by tp={tp}: choose a tp that divides it")
        if not self.is_moe and self.intermediate_size % tp:
            errors.append(f"intermediate_size={self.intermediate_size} is not divisible by tp={tp}")
        if self.is_moe and self.moe_intermediate_size % etp:
            name = "tp" if etp == tp else "etp"
            errors.append(f"moe_intermediate_size={self.moe_intermediate_size} is not divisible by {name}={etp}")
        if ep > 1 and not self.is_moe:
            errors.append(f"ep={ep}: expert parallelism needs a mixture-of-experts model ({self.model_type} is dense)")
        elif self.is_moe and self.num_experts % ep:
            errors.append(f"num_experts={self.num_experts} is not divisible by ep={ep}: choose ep among its divisors")
        if self.num_layers % pp:
            errors.append(f"num_hidden_layers={self.num_layers} is not divisible by pp={pp}: "
                          "choose pp among its divisors")
        if errors:
            layout = f"tp={tp} x pp={pp}" + (f" x ep={ep}" if ep > 1 else "") + (f" (etp={etp})" if etp != tp else "")
            raise ValueError(f"cannot split the model as {layout}:\n  " + "\n  ".join(errors))


def _rope_theta(cfg: dict[str, Any], problems: list[str]) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling")
    rope_type = (params.get("rope_type") or params.get("type") or "default") if params else "default"
    if scaling:
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        problems.append(f"rope scaling type {rope_type!r} (only default rotary embeddings are supported)")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def arch_from_hf_config(cfg: dict[str, Any]) -> QwenArch:
    """Read a HF Qwen2/Qwen2.5/Qwen3 ``config.json`` dict.

    Raises:
        UnsupportedConfigError: naming every field whose value cannot be represented.
    """
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedConfigError(
            f"model_type={model_type!r} (architectures={cfg.get('architectures')}) is not supported: "
            f"supported are {sorted(SUPPORTED_MODEL_TYPES)} ({', '.join(SUPPORTED_MODEL_TYPES.values())})"
        )
    problems = _size_problems(cfg)
    if problems:  # the rest divides by these
        raise UnsupportedConfigError(f"{model_type} config cannot be represented: " + "; ".join(problems))
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg['hidden_act']!r} (only 'silu' SwiGLU is supported)")
    layer_types = cfg.get("layer_types") or []
    if cfg.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        problems.append("use_sliding_window=true / sliding layer_types (only full attention is supported)")
    moe = _moe_fields(cfg, model_type, problems)
    rope_theta = _rope_theta(cfg, problems)
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    if heads % kv_heads:
        problems.append(f"num_attention_heads={heads} not divisible by num_key_value_heads={kv_heads}")
    qkv_bias = True if model_type == "qwen2" else bool(cfg.get("attention_bias", False))
    if problems:
        raise UnsupportedConfigError(f"{model_type} config cannot be represented: " + "; ".join(problems))
    return QwenArch(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        initializer_range=float(cfg.get("initializer_range", 0.02)),
        **moe,
    )


REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")


def _size_problems(cfg: dict[str, Any]) -> list[str]:
    """The sizes of ``cfg`` that are missing (required ones) or not a whole number >= 1 (``num_hidden_layers: -1``
    would build a model without layers, or fail deep inside megatron)."""
    problems = []
    for key in REQUIRED_SIZES + OPTIONAL_SIZES:
        if key not in cfg or (cfg[key] is None and key in OPTIONAL_SIZES):
            if key in REQUIRED_SIZES:
                problems.append(f"{key} missing")
            continue
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{key}={value!r} (must be a whole number >= 1)")
    return problems


def _moe_fields(cfg: dict[str, Any], model_type: str, problems: list[str]) -> dict[str, Any]:
    """The MoE fields of ``QwenArch`` from a HF config (empty for dense models); problems are appended."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)  # transformers 5 may write either
    if model_type != "qwen3_moe":
        if experts:
            problems.append(f"num_experts={experts} on a dense {model_type} config (a MoE model is qwen3_moe)")
        return {}
    if experts < 1:
        problems.append("num_experts missing or 0 (a qwen3_moe config needs its expert count)")
    if cfg.get("mlp_only_layers"):
        problems.append(f"mlp_only_layers={cfg['mlp_only_layers']} (only all-MoE decoders are supported)")
    if int(cfg.get("decoder_sparse_step", 1)) != 1:
        problems.append(f"decoder_sparse_step={cfg['decoder_sparse_step']} (only every layer MoE, step 1)")
    if cfg.get("shared_expert_intermediate_size"):
        problems.append("shared_expert_intermediate_size (Qwen3-MoE has no shared expert)")
    if int(cfg.get("moe_intermediate_size") or 0) < 1:
        problems.append("moe_intermediate_size missing or 0 (each expert's inner size)")
    top_k = int(cfg.get("num_experts_per_tok", 0))
    if not 1 <= top_k <= max(experts, 1):
        problems.append(f"num_experts_per_tok={top_k} must be in 1..num_experts={experts}")
    return dict(num_experts=experts, moe_top_k=top_k, moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)))


def bundled_asset(path: Path) -> Path | None:
    """This package's copy of ``megatron_offgrpo/assets/...`` (as recipes write it), whatever the working directory."""
    if path.parts[: len(ASSET_PREFIX)] != ASSET_PREFIX:
        return None
    candidate = ASSETS.joinpath(*path.parts[len(ASSET_PREFIX):])
    return candidate if candidate.exists() else None


def resolve_model_dir(path_or_id: str | Path) -> Path:
    """The local path of ``model.hf_path``: an existing path as is, then a bundled asset, then a hub id.

    A hub id (``owner/name``) comes from the HF cache, fetched first when online (config, tokenizer, safetensors).

    Raises:
        FileNotFoundError: the path does not exist and is not a hub id, or the hub cannot provide the id (offline,
            no network, unknown or gated repo); the message names it and says how to fix it.
    """
    path = Path(path_or_id).expanduser()
    if path.exists():
        return path
    bundled = bundled_asset(path)
    if bundled is not None:
        return bundled
    if not HUB_ID.fullmatch(str(path_or_id)):
        raise FileNotFoundError(f"{path_or_id}: no such file or directory (give a HF model directory or a hub id "
                                f"like Qwen/Qwen2.5-0.5B-Instruct)")
    return _fetch(str(path_or_id))


def _fetch(repo_id: str) -> Path:
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    logger.info("model %s: not a local path; fetching it from the HF hub (or its cache)", repo_id)
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except (OSError, ValueError) as exc:  # the hub's errors: offline, no network, unknown/gated repo, invalid id
        if isinstance(exc, LocalEntryNotFoundError):  # the hub could not be asked and the cache has no copy
            why = "HF_HUB_OFFLINE is set" if huggingface_hub.constants.HF_HUB_OFFLINE else "the hub cannot be reached"
            reason = f"{why} and it is not in the HF cache"
        else:
            reason = f"{type(exc).__name__}: {next(iter(str(exc).splitlines()), '')}"
        raise FileNotFoundError(f"{repo_id}: not a local directory, and the HF hub cannot provide it "
                                f"({reason}); on a machine with network run `hf download {repo_id} --local-dir DIR` "
                                f"and pass that DIR instead") from None


def load_arch(path: str | Path) -> QwenArch:
    """Read the arch from a HF model directory or a ``config.json`` path (or what ``resolve_model_dir`` accepts)."""
    path = resolve_model_dir(path)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: no HF config.json found (expected a HF model directory)")
    try:
        cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file}: not valid JSON ({exc})") from None
    return arch_from_hf_config(cfg)


def hf_config_dict(arch: QwenArch, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The HF ``config.json`` for ``arch`` (inverse of ``arch_from_hf_config``), merged over ``extra``."""
    cfg = dict(extra or {})
    cfg.update(
        architectures=[arch.hf_architecture],
        model_type=arch.model_type,
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        hidden_act="silu",
        rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        initializer_range=arch.initializer_range,
        use_sliding_window=False,
    )
    if arch.model_type in ("qwen3", "qwen3_moe"):
        cfg.update(head_dim=arch.head_dim, attention_bias=arch.qkv_bias)
    if arch.is_moe:
        cfg.pop("num_local_experts", None)
        cfg.update(num_experts=arch.num_experts, num_experts_per_tok=arch.moe_top_k,
                   moe_intermediate_size=arch.moe_intermediate_size, norm_topk_prob=arch.norm_topk_prob,
                   router_aux_loss_coef=arch.router_aux_loss_coef, decoder_sparse_step=1, mlp_only_layers=[])
    cfg.pop("rope_parameters", None)
    cfg.pop("rope_scaling", None)
    return cfg
