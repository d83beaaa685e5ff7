"""Rank 0's side of the wall: the engine, the prompt stream, the reward. It gives ``RolloutBatch`` (samples and
how they were sampled) out and takes weight buckets in; it never sees the policy."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Sequence

from megatron_offgrpo.config import Config, ConfigError
from megatron_offgrpo.data import Prompt, PromptStream, Sample, rewards
from megatron_offgrpo.envs import EnvironmentContractError
from megatron_offgrpo.model import load_tokenizer
from megatron_offgrpo.reward import RewardModel, RewardModelError, TemplateError
from megatron_offgrpo.rollout import RefreshReport, RolloutEngine, TeacherFleet, errors, make_engine, probes
from megatron_offgrpo.sampler._async import JOIN_TIMEOUT_S
from megatron_offgrpo.sampler._builders import engine_spec, reward_spec, verify_tolerance
from megatron_offgrpo.sampler._eval import evaluate
from megatron_offgrpo.sampler._generate import Rollouts, env_factory
from megatron_offgrpo.sampler._maker import BatchMaker
from megatron_offgrpo.sampler._prompts import build_prompts, load_data, log_data, prompt_length_error, used_records
from megatron_offgrpo.sampler._sampling import RolloutBatch
# RolloutState is defined with the sources; checkpoints written before pickled it under this module's name, which
# must keep resolving (train._checkpoint.load_rollout_state unpickles rollout_state.pt)
from megatron_offgrpo.sampler._sources import BatchSource, RolloutState, make_source
from megatron_offgrpo.transports import Buckets, adapters

logger = logging.getLogger(__name__)
STALENESS_KEYS = 8
"""Staleness histograms keep a share per value 0..7, then one for 8 and more (async bounds in use are 1 to 8)."""


@dataclasses.dataclass
class RolloutSide:
    """What generates and scores samples (global rank 0 only). ``rollout.mode`` is read once, in ``build``: it picks
    the batch source; nothing here branches on it after."""

    config: Config
    engine: RolloutEngine
    maker: BatchMaker  # a step's batch, generated now: the prompt stream, the rollouts, the teacher
    source: BatchSource  # rollout.mode's: which batch a step trains, generated when (sampler._sources)
    eval_prompts: list[Prompt]
    data_report: dict[str, int | str]  # both set sizes, where evaluation reads from, their overlap (run_info.json)
    _closed: bool = False

    @classmethod
    def build(cls, config: Config, model_dir: Path, run_dir: Path, max_positions: int,
              adapter: adapters.AdapterSpec | None = None) -> RolloutSide:
        """The engine serving ``model_dir`` (the policy exported as version 0), and the prompts it answers.

        Args:
            run_dir: a disk refresh writes its versions under it. max_positions: the model's context length.
            adapter: the policy's LoRA adapter when refreshes send only it (``lora.sync=adapter``).
        """
        tokenizer = load_tokenizer(config.model.hf_path)
        data = load_data(config)
        train_prompts = build_prompts(config, tokenizer, data.train)
        eval_prompts = (build_prompts(config, tokenizer, used_records(config, data, "eval"))
                        if config.train.eval_every else [])
        for split, prompts in ((config.data.split, train_prompts), (config.data.eval_split, eval_prompts)):
            error = prompt_length_error(prompts, config, max_positions, split)
            if error:  # before the engine starts
                raise ConfigError(error)
        stream = PromptStream(train_prompts, config.parallel.seed)
        reward_fn = rewards.get_reward(config.data.reward)
        try:
            make_env = env_factory(config, reward_fn)
        except (ValueError, EnvironmentContractError) as exc:  # before the engine starts
            raise ConfigError(str(exc)) from None
        reward_model = open_reward_model(config)  # before the engine: a model that does not load stops the run first
        try:
            engine = make_rollout_engine(config, model_dir, run_dir, max_positions, adapter)
            if config.rollout.mode == "async_partial" and not engine.partial_rollouts:
                engine.close()  # rollout.engine=auto fell back (its warning says why)
                raise ConfigError(f"rollout.mode=async_partial needs vLLM (in-process or a fleet); the run got the "
                                  f"{engine.name} engine: install vLLM, or set rollout.mode=async")
            if config.rollout.sync == "delta" and engine.name == "transformers":
                engine.close()  # rollout.engine=auto fell back (its warning says why)
                raise ConfigError("rollout.sync=delta needs vLLM (in-process or a fleet); the run got the "
                                  "transformers engine: install vLLM, or set rollout.sync=full")
        except BaseException:  # the reward model's threads and memory go with the run that did not start
            if reward_model is not None:
                reward_model.close()
            raise
        teacher = TeacherFleet.from_state(config.distill.teacher_fleet) if config.distill.teacher_fleet else None
        rollouts = Rollouts.build(config, engine, tokenizer, reward_fn, make_env, reward_model)
        maker = BatchMaker(config, stream, rollouts, teacher)
        source = make_source(config.rollout, maker, config.train.steps, engine.concurrent_generate)
        return cls(config, engine, maker, source, eval_prompts, log_data(config, data))

    def batch(self, step: int) -> RolloutBatch:
        """Step ``step``'s samples, from the mode's source (``sampler._sources``)."""
        return self.source.next_batch(step)

    def start(self, step: int) -> None:
        """The current step's refresh is done: a source that generates ahead (overlap) starts step ``step``'s
        batch (none past the last step)."""
        self.source.start(step)

    def install(self, buckets: Buckets | adapters.AdapterPayload, version: int) -> RefreshReport | None:
        """``engine.update_weights``, tolerating servers that failed when the others installed the version
        (then None, with a warning).

        A fleet server that died (or failed to install) since the last refresh leaves the rotation and the run goes
        on with the rest (a later refresh brings it back if it recovers); only a refresh that no server installed
        stops the run.
        """
        try:
            with self.source.refresh_access():
                return self.engine.update_weights(buckets, version)
        except errors.RefreshError as exc:
            if self.engine.version() != version:
                raise
            logger.warning("%s\ntraining goes on with the servers that installed version %d", exc, version)
            return None

    def verify(self, probe_ids: list[int], expected: list[float], version: int, bound: float | None = None) -> None:
        """Raise ``RefreshVerificationError`` unless every server reports ``version`` and scores ``probe_ids`` as
        ``expected`` (the trainer's log-probs) within the run's tolerance (``bound``: the model's derived one)."""
        atol = verify_tolerance(self.config.rollout, self.config.model.precision, bound)
        with self.source.refresh_access():  # async: waits for the steps in flight, unless async_partial
            probes.verify_refresh(self.engine, probe_ids, expected, version, atol)
        self.source.verified(version)

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy of the engine's weights on the eval prompts, and pass@k / avg@n with
        ``train.eval_samples`` n > 1 ({} without ``train.eval_every``)."""
        cfg = self.config
        if not cfg.train.eval_every:
            return {}
        with self.source.exclusive():
            return evaluate(self.maker.rollouts, self.eval_prompts, cfg.rollout.max_new_tokens,
                            samples=cfg.train.eval_samples,
                            temperature=cfg.rollout.temperature, seed=cfg.parallel.seed)

    def resume_state(self) -> RolloutState:
        """What a checkpoint keeps of this side: the batches generated but not trained, and the stream after them.

        Batches in flight (overlap's prefetch, the async steps' generation) are waited for, so that they are kept,
        and the stream's position is past them.
        """
        return self.source.resume_state()

    def load_resume_state(self, state: RolloutState) -> None:
        """A checkpoint's ``resume_state`` (before the first step)."""
        self.maker.stream.load_state_dict(state.stream)
        self.source.restore(state.ready)

    def close(self) -> None:
        """Every exit path (the end, a stop, an error): start no more generation, close the engine (a generation
        still in flight, started ahead or by the step that failed, ends with it), then join the generation threads,
        each wait bounded and named (``sampler._async.JOIN_TIMEOUT_S``). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.source.stop()
        try:
            self.engine.close()
        finally:  # the threads are joined even when the engine fails to close
            self.source.join(time.monotonic() + JOIN_TIMEOUT_S)
            if self.maker.teacher is not None:
                self.maker.teacher.close()
            if self.maker.rollouts.reward_model is not None:
                self.maker.rollouts.reward_model.close()


def open_reward_model(config: Config) -> RewardModel | None:
    """The reward model of ``reward.*`` loaded, or its fleet connected; None without one. Raises ``ConfigError``
    (one line) for a model, template or fleet that cannot serve."""
    try:
        spec = reward_spec(config)
        return None if spec is None else RewardModel.open(spec)
    except (TemplateError, RewardModelError, errors.FleetError) as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:  # transformers: no such directory or hub id, no weights
        key = "reward.judge" if config.reward.judge else "reward.model"
        raise ConfigError(f"{key}={config.reward.judge or config.reward.model}: does not load: "
                          f"{next(iter(str(exc).splitlines()), type(exc).__name__)}") from None


def make_rollout_engine(config: Config, model_dir: Path, run_dir: Path | None, max_positions: int,
                        adapter: adapters.AdapterSpec | None = None) -> RolloutEngine:
    """The engine of ``rollout.engine``, serving the weights in ``model_dir`` as version 0 (rank 0 only).

    Args:
        run_dir: the run directory (a disk refresh writes its versions under it; None: an engine never refreshed).
        max_positions: the model's ``max_position_embeddings`` (caps vLLM's ``max_model_len``).
        adapter: LoRA with adapter refreshes: the engine serves ``model_dir`` plus this adapter (zero at version 0).
    """
    try:
        return make_engine(engine_spec(config, model_dir, run_dir, max_positions, adapter))
    except errors.UnservableModelError as exc:  # engine=vllm asked for explicitly (auto falls back): one line, exit 2
        raise ConfigError(f"rollout.engine=vllm: {exc}: use rollout.engine=auto (falls back to the transformers "
                          "engine) or rollout.engine=transformers") from None


def length_metrics(lengths: Sequence[int]) -> dict[str, float]:
    """Response lengths (tokens): ``response_len`` (the mean), ``_min``, ``_p50``, ``_p90``, ``_max``; a percentile is
    the nearest rank, a length some response has (p90 of 1..10 is 9)."""
    ordered, n = sorted(lengths), len(lengths)

    def rank(q: int) -> int:
        return ordered[max(math.ceil(q * n / 100), 1) - 1]

    return {"response_len": sum(ordered) / n, "response_len_min": ordered[0], "response_len_p50": rank(50),
            "response_len_p90": rank(90), "response_len_max": ordered[-1]}


def sample_metrics(samples: Sequence[Sample], step: int, staleness_bound: int) -> dict[str, float]:
    """Rewards (their mean and population std over the batch; accuracy: of the task's score, shaping left out),
    lengths (``length_metrics``), the fraction cut at the length limit (``truncated_fraction``: finish reason
    "length"), the share of samples whose group was sent again after a server failed (``resent_fraction``) and
    staleness (step - policy_version) of a step's samples; raises when a sample is older than
    ``staleness_bound`` steps (the engine did not serve the weights it was sent)."""
    values = [step - s.policy_version for s in samples]
    if max(values) > staleness_bound or min(values) < 0:
        raise RuntimeError(
            f"step {step}: sample staleness {min(values)}..{max(values)} outside [0, {staleness_bound}] "
            f"(versions {sorted({s.policy_version for s in samples})}): the engine did not serve the expected weights"
        )
    hist = collections.Counter(values)
    rewards, n = [s.reward for s in samples], len(samples)
    mean = sum(rewards) / n
    return {"reward_mean": mean, "reward_std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
            "accuracy": sum(task_score(s) >= 1.0 for s in samples) / n, **reward_model_metrics(samples),
            **length_metrics([len(s.response_ids) for s in samples]),
            "truncated_fraction": sum(s.finish_reason == "length" for s in samples) / n,
            "overlong_penalty_mean": sum(s.shaping for s in samples) / n,
            "resent_fraction": sum(s.attempts > 1 for s in samples) / n,
            "staleness_max": max(values), "staleness_mean": sum(values) / len(values),
            **staleness_shares("staleness_", hist, staleness_bound),
            **token_staleness_metrics(samples, step, staleness_bound)}


def task_score(sample: Sample) -> float:
    """The task's own score of a sample: the rule's (gold) beside a reward model, else its reward without shaping."""
    return sample.gold_reward if sample.gold_reward is not None else sample.reward - sample.shaping


def reward_model_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Beside a reward model: its mean score (``reward_model_mean``, before clip and normalisation), the gold's
    (``reward_gold_mean``, the rule's, when the prompts have answers) and the share of judge replies without a
    verdict (``reward_model_unparsed``; 0 for a classifier); {} without one."""
    scored = [s for s in samples if s.model_score is not None]
    if not scored:
        return {}
    values = {"reward_model_mean": sum(s.model_score for s in scored) / len(scored),
              "reward_model_unparsed": sum(not s.model_parsed for s in scored) / len(scored)}
    gold = [s.gold_reward for s in scored if s.gold_reward is not None]
    if gold:
        values["reward_gold_mean"] = sum(gold) / len(gold)
    return values


def staleness_shares(prefix: str, counts: collections.Counter[int], bound: int) -> dict[str, float]:
    """The share of ``counts`` at each staleness 0..``bound`` (``{prefix}K``), the values from ``STALENESS_KEYS``
    on summed into one ``{prefix}{STALENESS_KEYS}plus``: at most ``STALENESS_KEYS + 1`` keys whatever the bound, since
    every record goes to each tracker (a key per value up to a bound of 1000 made 51 kB records; the mean and the max
    beside them say how far the tail goes)."""
    total = max(1, sum(counts.values()))
    shares = {f"{prefix}{k}": counts[k] / total for k in range(min(bound, STALENESS_KEYS - 1) + 1)}
    if bound >= STALENESS_KEYS:
        shares[f"{prefix}{STALENESS_KEYS}plus"] = sum(n for k, n in counts.items() if k >= STALENESS_KEYS) / total
    return shares


def token_staleness_metrics(samples: Sequence[Sample], step: int, staleness_bound: int) -> dict[str, float]:
    """Per response token, step - the version that sampled it: the mean (``token_staleness_mean``; with partial
    rollouts a sample's tokens after a refresh are fresher than its first) and the share of the step's tokens at each
    staleness 0..``staleness_bound`` (``token_staleness_{k}``: the tokens of version step - k; ``staleness_shares``
    caps the keys); and the share of samples a refresh came in the middle of (``partial_fraction``)."""
    # Per sample, not per token: a sample of one version (the common case) adds its length at its staleness.
    tokens_at: collections.Counter[int] = collections.Counter()
    for s in samples:
        if s.token_versions is None:
            tokens_at[step - s.policy_version] += len(s.response_ids)
        else:
            tokens_at.update(step - v for v in s.token_versions)
    tokens = max(1, sum(tokens_at.values()))
    return {"token_staleness_mean": sum(k * n for k, n in tokens_at.items()) / tokens,
            **staleness_shares("token_staleness_", tokens_at, staleness_bound),
            "partial_fraction": sum(s.token_versions is not None for s in samples) / max(1, len(samples))}
