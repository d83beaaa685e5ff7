"""DAPO dynamic sampling (``rollout.dynamic_sampling``): the batch holds B groups with reward variance, refilled from
the prompt stream within ``rollout.max_sampling_rounds``; counted, reproducible, resumable, and a clear stop when
no group has variance. The fill logic on hand-worked reward tables, then the real rollout side (tiny Qwen2, the
transformers engine, the real tokenizer and arithmetic prompts) in this process, then short `offgrpo train` runs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron_offgrpo.algo import AdvantageParams, compute_group_advantages
from megatron_offgrpo.config import load_config
from megatron_offgrpo.data import PromptStream, Sample
from megatron_offgrpo.sampler import load_prompts
from megatron_offgrpo.sampler._rollout_side import RolloutSide
from megatron_offgrpo.sampler._sampling import NoLearningSignalError, SamplingStats, fill_batch, round_seed
from tests.helpers import REPO
from tests.train.conftest import TINY, run_train, train_env
from tests.train.rewards import answer_value

DYNAMIC = ["rollout.dynamic_sampling=true"]
ODD_ZERO = "data.reward=tests.train.rewards:odd_answers_score_zero"
ALWAYS_ZERO = "data.reward=tests.train.rewards:always_zero"


def _table_draw(rounds: list[list[list[float]]], asked: list[int]):
    """``fill_batch``'s ``draw`` over fixed reward tables: round r returns ``rounds[r]`` as scored groups (prompt ids
    ``r/b``), recording how many prompts each round asked for in ``asked``."""

    def draw(round_: int, prompts: int) -> list[Sample]:
        asked.append(prompts)
        table = rounds[round_]
        assert len(table) == prompts, f"round {round_} asked for {prompts} prompts, the table has {len(table)}"
        return [Sample(f"{round_}/{b}", b, [1], [2], [0.0], 0, "stop", reward=r)
                for b, group in enumerate(table) for r in group]

    return draw


def _rewards(samples: list[Sample], group_size: int) -> list[list[float]]:
    return [[s.reward for s in samples[b:b + group_size]] for b in range(0, len(samples), group_size)]


def test_refill_rounds_ask_for_the_missing_groups_times_oversample():
    # B=3, G=2. Round 0 asks ceil(3 x 1.5) = 5: two groups have variance ([0, 1] at 0/1, [1, 0] at 0/3).
    # Round 1 asks ceil((3 - 2) x 1.5) = 2: one has variance ([0.5, 0] at 1/1): the batch is full.
    asked: list[int] = []
    rounds = [[[1, 1], [0, 1], [0, 0], [1, 0], [1, 1]], [[0, 0], [0.5, 0]]]
    batch = fill_batch(_table_draw(rounds, asked), 3, 2, 4, 1.5, AdvantageParams(), step=0)
    assert asked == [5, 2]
    assert [s.prompt_id for s in batch.samples[::2]] == ["0/1", "0/3", "1/1"]  # the draw order
    assert [s.group_id for s in batch.samples] == [0, 0, 1, 1, 2, 2]  # renumbered: contiguous, group-major
    assert _rewards(batch.samples, 2) == [[0, 1], [1, 0], [0.5, 0]]
    # 7 generated = 3 valid + 4 dropped (the equal-reward ones), nothing kept to fill, no surplus
    assert batch.stats == SamplingStats(rounds=2, generated=7, valid=3, dropped=4, degenerate_kept=0, surplus=0)
    assert batch.metrics() == {"sampling_rounds": 2, "groups_generated": 7, "groups_valid": 3, "groups_dropped": 4,
                               "groups_degenerate_kept": 0, "groups_surplus": 0}
    # the filter is the advantages' own criterion: no group of the batch is masked
    adv = compute_group_advantages(torch.tensor([s.reward for s in batch.samples]), 2)
    assert bool(adv.group_valid.all()) and float(adv.masked_group_fraction) == 0.0


def test_surplus_groups_with_variance_are_counted_and_left_out():
    # B=2, oversample 2: round 0 asks 4, three have variance: the first two fill the batch, one is surplus
    batch = fill_batch(_table_draw([[[0, 1], [0, 0], [1, 0], [1, 0]]], []), 2, 2, 4, 2.0, AdvantageParams(), step=0)
    assert [s.prompt_id for s in batch.samples[::2]] == ["0/0", "0/2"]
    assert batch.stats == SamplingStats(rounds=1, generated=4, valid=2, dropped=1, degenerate_kept=0, surplus=1)


def test_when_the_rounds_run_out_the_first_discarded_groups_fill_the_batch():
    # B=3, 2 rounds: round 0 has one group with variance (0/0), round 1 (asks 2) none. The first two discarded
    # groups (0/1 all 0, 0/2 all 1) fill the batch in draw order; 1/0 and 1/1 stay dropped.
    batch = fill_batch(_table_draw([[[0, 1], [0, 0], [1, 1]], [[0, 0], [1, 1]]], []), 3, 2, 2, 1.0,
                       AdvantageParams(), step=0)
    assert [s.prompt_id for s in batch.samples[::2]] == ["0/0", "0/1", "0/2"]
    assert [s.group_id for s in batch.samples] == [0, 0, 1, 1, 2, 2]
    assert batch.stats == SamplingStats(rounds=2, generated=5, valid=1, dropped=2, degenerate_kept=2, surplus=0)
    adv = compute_group_advantages(torch.tensor([s.reward for s in batch.samples]), 2)
    assert adv.group_valid.tolist() == [True, False, False]  # the fill is masked as without dynamic sampling


@pytest.mark.parametrize("rounds, cause", [
    ([[[0, 0], [0, 0]], [[0, 0], [0, 0]]], "4 all 0.0; the task is too hard for the policy"),
    ([[[1, 1], [1, 1]], [[1, 1], [1, 1]]], "4 all 1.0; the task is too easy for the policy"),
    ([[[1, 1], [0, 0]], [[0, 0], [0, 0]]], "3 all 0.0, 1 all 1.0; each prompt is either always solved or never"),
    ([[[0.5, 0.5], [0, 0]], [[0, 0], [0, 0]]], "3 all 0.0, 1 all 0.5; the reward gives every completion"),
])
def test_no_group_with_variance_stops_with_the_cause_and_the_counts(rounds, cause):
    with pytest.raises(NoLearningSignalError) as err:
        fill_batch(_table_draw(rounds, []), 2, 2, 2, 1.0, AdvantageParams(), step=7)
    message = str(err.value)
    assert message.startswith("step 7: dynamic sampling found no group with reward variance in 2 round(s) "
                              "(rollout.max_sampling_rounds=2): of 4 groups of G=2, ")
    assert cause in message and "\n" not in message, message


def test_each_round_has_its_own_reproducible_seed():
    assert round_seed(1234, 5, 0) == 1234 + 100_003 * 5  # round 0: the seed of a run without dynamic sampling
    seeds = {round_seed(1234, step, r) for step in range(50) for r in range(8)}
    assert len(seeds) == 50 * 8 and round_seed(1234, 3, 2) == round_seed(1234, 3, 2)
    assert round_seed(1234, 3, 2) != round_seed(1235, 3, 2)


# ---- the real rollout side: tiny Qwen2 (random weights), transformers engine, arithmetic prompts ----------------


def _side(tiny_hf_dir, tmp_path, *overrides: str) -> RolloutSide:
    config = load_config(None, [*TINY, f"train.out_dir={tmp_path}", *DYNAMIC, *overrides])
    return RolloutSide.build(config, tiny_hf_dir, tmp_path, max_positions=512)


@pytest.mark.slow  # a real run (or engine): over a minute on the 2-core machine
def test_the_rollout_side_refills_to_b_groups_with_variance(tiny_hf_dir, tmp_path):
    side = _side(tiny_hf_dir, tmp_path, ODD_ZERO, "rollout.max_sampling_rounds=8")
    try:
        B, G = 4, 4
        batch = side.maker.generate(0)
        samples, stats = batch.samples, batch.stats
        assert len(samples) == B * G and [s.group_id for s in samples] == [b for b in range(B) for _ in range(G)]
        assert all(len({s.prompt_id for s in samples[b * G:(b + 1) * G]}) == 1 for b in range(B))
        adv = compute_group_advantages(torch.tensor([s.reward for s in samples]), G)
        assert bool(adv.group_valid.all())  # every kept group has variance
        assert {s.policy_version for s in samples} == {side.engine.version()} == {0}  # the engine's version
        # the prompts it took: the stream's next `generated`, in order (a fresh stream of the same seed replays them)
        prompts = load_prompts(side.config, side.maker.rollouts.tokenizer, side.config.data.split)
        taken = PromptStream(prompts, side.config.parallel.seed).next_batch(stats.generated)
        assert side.maker.stream.state_dict()["position"] == stats.generated
        odd = [p.prompt_id for p in taken if answer_value(p.answer) % 2]
        kept = [samples[b * G].prompt_id for b in range(B)]
        # the reward's design: an odd answer's group is all 0 (always dropped); kept ones are even-answer prompts
        assert odd and not set(odd) & set(kept) and stats.dropped >= len(odd)
        assert stats.rounds >= 2 and stats.valid == B and stats.degenerate_kept == 0 and stats.surplus == 0
        assert stats.generated == stats.valid + stats.dropped
        assert kept == [p.prompt_id for p in taken if p.prompt_id in kept]  # draw order kept

        # resume: the stream position of a checkpoint replays the same refills
        state = side.resume_state()
        first = side.maker.generate(1)
        side.load_resume_state(state)
        again = side.maker.generate(1)
        assert first.stats == again.stats
        assert [(s.prompt_id, s.response_ids, s.reward) for s in first.samples] == [
            (s.prompt_id, s.response_ids, s.reward) for s in again.samples]
    finally:
        side.close()


def test_a_checkpoint_keeps_the_overlap_prefetch_or_draws_a_failed_ones_prompts_again(tiny_hf_dir, tmp_path):
    """rollout.mode=overlap: a finished prefetch is kept in the checkpoint (its prompts are not drawn twice); a failed
    one leaves the stream where it was before it drew (its prompts are not skipped)."""
    side = _side(tiny_hf_dir, tmp_path, "rollout.mode=overlap", "rollout.dynamic_sampling=false")
    try:
        side.start(0)
        state = side.resume_state()
        assert list(state.ready) == [0] and state.stream["position"] == 4  # B = 4 prompts drawn, batch kept
        assert side.batch(0) is state.ready[0]

        def engine_died(step, round_, count, drawn, episodes, scoring):
            side.maker.stream.next_batch(count)  # the prompts are drawn, then the engine fails
            raise RuntimeError("the engine died")

        side.maker._draw = engine_died
        side.start(1)
        state = side.resume_state()
        assert state.ready == {} and state.stream["position"] == 4 and side.maker.stream.state_dict()["position"] == 8
        with pytest.raises(RuntimeError, match="the engine died"):
            side.batch(1)
    finally:
        side.close()


def test_one_round_keeps_the_shape_and_says_how_many_groups_are_degenerate(tiny_hf_dir, tmp_path, caplog):
    # even_length, one round: the batch is the first round's 4 groups, whatever their variance (no refill)
    side = _side(tiny_hf_dir, tmp_path, "rollout.max_sampling_rounds=1")
    try:
        with caplog.at_level("INFO", logger="megatron_offgrpo.sampler._maker"):
            batch = side.maker.generate(0)
        stats, G = batch.stats, 4
        equal = [len({s.reward for s in batch.samples[b * G:(b + 1) * G]}) == 1 for b in range(4)]
        # the tiny model's step-0 round has a group whose completions all decode to an odd length (all 0.0)
        assert any(equal) and not all(equal)
        assert len(batch.samples) == 16 and stats.rounds == 1 and stats.generated == 4 and stats.dropped == 0
        assert stats.degenerate_kept == sum(equal) and stats.valid == 4 - sum(equal)
        adv = compute_group_advantages(torch.tensor([s.reward for s in batch.samples]), G)
        assert adv.group_valid.tolist() == [not e for e in equal]  # the kept degenerate groups are masked
        assert f"step 0: {sum(equal)} of 4 groups without reward variance after 1 sampling rounds" in caplog.text
    finally:
        side.close()


def test_the_rollout_side_stops_when_no_group_has_variance(tiny_hf_dir, tmp_path):
    side = _side(tiny_hf_dir, tmp_path, ALWAYS_ZERO, "rollout.max_sampling_rounds=2")
    try:
        with pytest.raises(NoLearningSignalError, match=r"^step 3: .* of 8 groups of G=4, 8 all 0\.0; the task is "
                                                        r"too hard for the policy"):
            side.maker.generate(3)
    finally:
        side.close()


def test_without_dynamic_sampling_the_batch_is_one_round_and_has_no_counts(tiny_hf_dir, tmp_path):
    side = _side(tiny_hf_dir, tmp_path, ODD_ZERO, "rollout.dynamic_sampling=false")
    try:
        batch = side.maker.generate(0)
        assert batch.stats is None and list(batch.metrics()) == ["generate_s"] and len(batch.samples) == 16
        assert side.maker.stream.state_dict()["position"] == 4
    finally:
        side.close()


# ---- `offgrpo train` runs --------------------------------------------------------------------------------------


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("nproc, extra", [(2, ["parallel.tp=2"]), (1, ["rollout.mode=overlap"])],
                         ids=["tp2", "overlap"])
def test_a_run_with_dynamic_sampling_logs_its_counts(tmp_path, nproc, extra):
    records = run_train(nproc, tmp_path, *DYNAMIC, ODD_ZERO, "rollout.max_sampling_rounds=8", "train.steps=3",
                        *extra)
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["groups_valid"] + r["groups_degenerate_kept"] == 4
        assert r["groups_generated"] == r["groups_valid"] + r["groups_degenerate_kept"] + r["groups_dropped"] + \
            r["groups_surplus"]
        assert 1 <= r["sampling_rounds"] <= 8 and r["groups_dropped"] >= 1  # odd answers are always dropped
        # the effective batch changed, the objective did not: only a degenerate fill is masked
        assert r["masked_group_fraction"] == r["groups_degenerate_kept"] / 4
        assert r["staleness_max"] <= int("rollout.mode=overlap" in extra)


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_run_without_any_group_with_variance_stops_with_one_line(tmp_path):
    """Async on the in-process vLLM engine: step 1 generates beside step 0 when step 0's error ends the run; the
    exit path joins it (a thread left inside vLLM at exit aborted the process, exit 134, one run in two)."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megatron_offgrpo.cli", "train", *TINY, f"train.out_dir={out}",
                           *DYNAMIC, ALWAYS_ZERO, "rollout.max_sampling_rounds=2", "train.steps=4",
                           "rollout.mode=async", "rollout.engine=vllm", "rollout.refresh_every=2"],
                          cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "terminate called" not in proc.stderr and "left behind" not in proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert line.startswith("error: step 0: dynamic sampling found no group with reward variance in 2 round(s)")
    assert "8 all 0.0; the task is too hard for the policy" in line and "Traceback" not in proc.stderr
