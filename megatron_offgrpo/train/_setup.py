"""Everything a run needs, built once: layout, model + optimizer, data, engine, logs (the recipe's ``setup``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
from pathlib import Path
from typing import Any

import torch

from megatron_offgrpo.algo import AdvantageParams, ObjectiveParams
from megatron_offgrpo.config import Config
from megatron_offgrpo.data import ASSETS, PromptStream, SamplingParams, build_prompt, get_reward, load_records
from megatron_offgrpo.model import QwenArch, load_arch, resolve_model_dir
from megatron_offgrpo.runtime import ParallelContext, init_parallel
from megatron_offgrpo.train._checkpoint import sweep_partial_checkpoints
from megatron_offgrpo.train._metrics import MetricsLog
from megatron_offgrpo.train._policy import Policy, build_policy, frozen_copy
from megatron_offgrpo.train.builders import sampling_params

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Run:
    """The state of one training run on this rank (engine, stream and log exist on rank 0 only)."""

    config: Config
    ctx: ParallelContext
    arch: QwenArch
    policy: Policy
    tokenizer: Any
    obj_params: ObjectiveParams
    adv_params: AdvantageParams
    sampling: SamplingParams
    reward_fn: Any
    stream: PromptStream
    probe_ids: list[int]
    snapshot: torch.nn.Module | None = None
    reference: torch.nn.Module | None = None
    engine: Any = None
    log: MetricsLog | None = None
    eval_prompts: list | None = None
    executor: Any = None  # rank 0 with rollout.overlap: generates the next batch during this step's training
    pending: Any = None  # the future of that batch
    version: int = 0

    def close(self) -> None:
        """Release the engine and flush the logs."""
        if self.executor is not None:
            self.executor.shutdown(wait=True)
        if self.engine is not None:
            self.engine.close()
        if self.log is not None:
            self.log.close()


def load_tokenizer(hf_path: str):
    """The model directory's tokenizer, or the bundled Qwen2.5 tokenizer when the directory has none (``hf_path``:
    anything ``resolve_model_dir`` accepts)."""
    import transformers

    model_dir = resolve_model_dir(hf_path)
    has_own = (model_dir / "tokenizer_config.json").exists()
    return transformers.AutoTokenizer.from_pretrained(model_dir if has_own else ASSETS / "qwen2-tokenizer")


def load_prompts(config: Config, tokenizer, split: str) -> list:
    """The prompts of ``split`` of the recipe's dataset, built as the engine sees them."""
    d = config.data
    records = load_records(d.name, split, d.source, d.path, question_key=d.question_key, answer_key=d.answer_key,
                           count=d.count, seed=config.parallel.seed, max_operand=d.max_operand)
    return [build_prompt(r, tokenizer, d.system_prompt, d.instruction, d.max_prompt_tokens, d.prompt_format)
            for r in records]


def _write_run_info(run_dir: Path, config: Config, ctx: ParallelContext, arch: QwenArch) -> None:
    import megatron.core
    import transformers

    info = {"config": config.to_dict(), "world_size": ctx.world_size, "tp": ctx.tp_size, "pp": ctx.pp_size,
            "dp": ctx.dp_size, "arch": dataclasses.asdict(arch), "torch": torch.__version__,
            "megatron_core": megatron.core.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "device": str(ctx.device)}
    (run_dir / "run_info.json").write_text(json.dumps(info, indent=1, default=str))


def setup_run(config: Config) -> Run:
    """Build the run (collective). Rank 0 also exports version 0 and starts the engine on it."""
    from megatron_offgrpo.rollout import make_probe_ids
    from megatron_offgrpo.train._weights import export_hf_dir

    ctx = init_parallel(config.parallel.tp, config.parallel.pp, config.parallel.seed)
    torch.use_deterministic_algorithms(config.train.deterministic)
    run_dir = Path(config.train.out_dir)
    config.model.hf_path = str(resolve_model_dir(config.model.hf_path))  # once: hub id / bundled asset -> dir
    arch = load_arch(config.model.hf_path)
    policy = build_policy(arch, ctx, config.model, config.optim, config.train.steps)
    tokenizer = load_tokenizer(config.model.hf_path)
    r = config.rollout
    run = Run(config, ctx, arch, policy, tokenizer,
              config.algo.objective_params(r.drgrpo_constant()),
              config.algo.advantage_params(), sampling_params(r, seed=config.parallel.seed),
              get_reward(config.data.reward), PromptStream(load_prompts(config, tokenizer, config.data.split),
                                                           config.parallel.seed),
              probe_ids=make_probe_ids(arch.vocab_size))
    if r.behavior_logprobs == "recompute":
        run.snapshot = frozen_copy(policy.model, arch, ctx, config.model)
    if config.algo.kl_beta > 0:
        run.reference = frozen_copy(policy.model, arch, ctx, config.model)
    if ctx.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        sweep_partial_checkpoints(run_dir)
        _write_run_info(run_dir, config, ctx, arch)
    v0 = export_hf_dir(policy.model, arch, ctx, run_dir / "weights" / "v0", Path(config.model.hf_path))
    if ctx.rank == 0:
        from megatron_offgrpo.train._rollout_side import make_rollout_engine

        run.engine = make_rollout_engine(config, v0, run_dir, arch.max_position_embeddings)
        if config.train.eval_every:
            run.eval_prompts = load_prompts(config, tokenizer, config.data.eval_split)[: config.train.eval_prompts]
        run.log = MetricsLog(run_dir, config.train.steps)
        if r.overlap:
            import concurrent.futures

            run.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="offgrpo-rollout")
        logger.info("run %s: %s, tp=%d pp=%d dp=%d, engine %s, v=%d, %s", run_dir, arch.model_type, ctx.tp_size,
                    ctx.pp_size, ctx.dp_size, type(run.engine).__name__, r.refresh_every, config.algo.objective)
    return run
