"""A step's batch, generated now: the step's prompts drawn from the stream, G samples each, rewarded, shaped and
(distillation) teacher-scored. Every batch source (``sampler._sources``) makes its batches here; only when differs."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

from megatron_offgrpo.algo import overlong_penalty
from megatron_offgrpo.config import Config
from megatron_offgrpo.data import PromptStream, Sample
from megatron_offgrpo.rollout import TeacherFleet, multiturn
from megatron_offgrpo.runtime import release_free_memory
from megatron_offgrpo.sampler._builders import sampling_params
from megatron_offgrpo.sampler._generate import Rollouts, ScoreTiming
from megatron_offgrpo.sampler._sampling import RolloutBatch, fill_batch, round_seed

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class BatchMaker:
    """Step -> its scored batch, from the prompt stream (drawn in step order, also from generation threads)."""

    config: Config
    stream: PromptStream
    rollouts: Rollouts  # prompts -> rewarded samples (completions, or multi-turn episodes)
    teacher: TeacherFleet | None = None  # distill.teacher_fleet: scores every sample of a step once generated
    _stream_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # steps draw from threads

    def generate(self, step: int, drawn: Callable[[], None] = lambda: None) -> RolloutBatch:
        """The next prompts, G samples each, scored; with a fresh reproducible sampling seed per step (per round).

        With ``rollout.dynamic_sampling``, groups whose rewards are all equal are discarded and further rounds refill
        the batch from the stream (``sampler._sampling.fill_batch``). Samples carry the version that generated them
        (with ``rollout.mode=async_partial`` a refresh may come during a step: then each token carries its own).
        ``drawn()`` is called once the first round's prompts are drawn (the async modes start the next step then).
        """
        start, episodes, scoring = time.perf_counter(), multiturn.EpisodeStats(), ScoreTiming()
        batch = self._fill(step, drawn, episodes, scoring)
        batch.timing["generate_s"] = time.perf_counter() - start
        if self.rollouts.reward_model is not None:
            batch.timing |= scoring.metrics()
        if self.teacher is not None:  # the trained samples only (not the groups dynamic sampling left out)
            start = time.perf_counter()
            self.teacher.score(batch.samples)
            batch.timing["teacher_s"] = time.perf_counter() - start
        batch.episodes = episodes.metrics()
        return batch

    def _fill(self, step: int, drawn: Callable[[], None], episodes: multiturn.EpisodeStats,
              scoring: ScoreTiming) -> RolloutBatch:
        r = self.config.rollout
        if not r.dynamic_sampling:
            return RolloutBatch(self._draw(step, 0, r.prompts_per_step, drawn, episodes, scoring))
        batch = fill_batch(lambda round_, prompts: self._draw(step, round_, prompts, drawn, episodes, scoring),
                           r.prompts_per_step, r.group_size, r.max_sampling_rounds, r.oversample,
                           self.config.algo.advantage_params(), step)
        if batch.stats.degenerate_kept:
            logger.info("step %d: %d of %d groups without reward variance after %d sampling rounds (masked; "
                        "rollout.max_sampling_rounds)", step, batch.stats.degenerate_kept, r.prompts_per_step,
                        batch.stats.rounds)
        return batch

    def _draw(self, step: int, round_: int, count: int, drawn: Callable[[], None],
              episodes: multiturn.EpisodeStats, scoring: ScoreTiming) -> list[Sample]:
        """The next ``count`` prompts of the stream, G scored samples each, group-major."""
        cfg = self.config
        params = sampling_params(cfg.rollout, seed=round_seed(cfg.parallel.seed, step, round_), step=step)
        with self._stream_lock:
            prompts, group_size = self.stream.next_batch(count), cfg.rollout.group_size
        drawn()
        samples = self.rollouts(prompts, group_size, params, episodes, scoring)
        release_free_memory()  # the decode steps' logits: not kept beside the optimizer step's buffers
        if len(samples) != len(prompts) * group_size:
            raise RuntimeError(f"engine returned {len(samples)} samples for {len(prompts)} prompts x G={group_size}")
        if cfg.rollout.overlong_buffer:  # against the longest response allowed: a completion's, or an episode's
            limit = cfg.env.episode_tokens(cfg.rollout.max_new_tokens) if cfg.env.name else cfg.rollout.max_new_tokens
            for sample in samples:
                sample.shaping = overlong_penalty(len(sample.response_ids), limit, cfg.rollout.overlong_buffer,
                                                  cfg.rollout.overlong_penalty)
                sample.reward += sample.shaping
        return samples
