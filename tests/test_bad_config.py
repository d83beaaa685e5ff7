"""Bad recipes, keys, values and models: every command that takes a recipe answers with one line per error, naming
the key (or file), exit code 2, and writes nothing; the loader itself never raises anything else, whatever it reads."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_offgrpo.cli import main
from megatron_offgrpo.config import Config, ConfigError, load_config
from tests.helpers import REPO, TOKENIZER_DIR

TINY = str(REPO / "configs" / "tiny-cpu-sft.yaml")
CASES = [  # (overrides, what the message must name)
    (["optim.lr=-1"], "optim.lr=-1.0: must be > 0"),
    (["optim.lr=nan"], "optim.lr=nan: must be a finite number"),
    (["optim.adam_beta1=1.5"], "optim.adam_beta1=1.5: must be in [0, 1)"),
    (["optim.warmup_steps=-3"], "optim.warmup_steps=-3: must be >= 0"),
    (["optim.min_lr=0.1"], "optim.min_lr=0.1: must be in [0, optim.lr=0.003]"),
    (["rollout.verify_tolerance=-1"], "rollout.verify_tolerance=-1.0: must be >= 0"),
    (["data.count=0"], "data.count=0: must be >= 1"),
    (["rollout.max_sampling_rounds=0"], "rollout.max_sampling_rounds=0: must be >= 1"),
    (["rollout.oversample=0.5"], "rollout.oversample=0.5: must be >= 1"),
    (["rollout.dtype=float16"], "rollout.dtype='float16': expected one of ['auto', 'float32', 'bfloat16']"),
    (["rollout.overlong_buffer=9", "rollout.max_new_tokens=8"], "rollout.overlong_buffer=9: must be in [0, "),
    (["rollout.overlong_buffer=-1"], "rollout.overlong_buffer=-1: must be in [0, "),
    (["rollout.overlong_penalty=-0.5"], "rollout.overlong_penalty=-0.5: must be >= 0"),
    (["parallel.tp=0"], "parallel.tp=0: must be >= 1"),
    (["parallel.pp=-1"], "parallel.pp=-1: must be >= 1"),
    (["parallel.etp=0"], "parallel.etp=0: must be >= 1"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=true needs parallel.tp > 1 (tp=1)"),
    (["model.hf_path=megatron_offgrpo/assets/tiny-qwen3-moe", "parallel.tp=2", "parallel.sequence_parallel=false"],
     "parallel.sequence_parallel=false with parallel.tp=2: megatron trains mixture-of-experts layers with tp > 1 "
     "only under sequence parallelism"),
    (["rollout.top_p=0.9"], "rollout.top_p=0.9: the trainer scores tokens under the whole softmax"),
    # the keys folded into rollout.mode: refused, with the new spelling
    (["rollout.partial_rollouts=true"], "rollout.partial_rollouts is now rollout.mode=async_partial"),
    (["rollout.overlap=false"], "rollout.overlap is now rollout.mode=overlap (overlap=false: the default"),
    (["rollout.mode=async_partial", "rollout.engine=transformers"],
     "partial rollouts need vLLM (engine=vllm, auto or fleet), without router replay"),
    (["rollout.mode=overlap", "rollout.behavior_logprobs=recompute"],
     "rollout.behavior_logprobs='recompute' with rollout.mode='overlap': the snapshot holds the weights last pushed"),
    (["rollout.mode=lockstep", "rollout.max_staleness=2"], "it bounds async generation (mode='async' or"),
    (["rollout.mode=async", "rollout.max_staleness=1000000000"],
     "rollout.max_staleness=1000000000: the async staleness bound must be <= 64; every step it allows generates"),
    (["rollout.mode=async", "rollout.refresh_every=65"],  # the bound's default, v, is held to the same limit
     "rollout.refresh_every (the bound when rollout.max_staleness is null)=65: the async staleness bound must be"),
    (["parallel.tp=3"], "num_attention_heads=2 is not divisible by tp=3"),
    (["parallel.pp=3"], "num_hidden_layers=2 is not divisible by pp=3"),
    (["model.hf_path=/nonexistent/model"], "model.hf_path=/nonexistent/model: "),
    (["rollout.group_size=[1,"], "override 'rollout.group_size=[1,': the value is not a YAML scalar"),
    (["optim.lr=fast"], "optim.lr='fast': expected float"),
    (["optim.learning_rate=1"], "unknown config key 'optim.learning_rate'"),
    (["train.loggers=[tensorbord]"], "train.loggers=['tensorbord']: unknown ['tensorbord']; valid: ['tensorboard', "),
    (["train.samples_every=-1"], "train.samples_every=-1: must be >= 0"),
    (["optim.shared_prompt=true"], "optim.shared_prompt=true needs optim.packing=true"),
    (["model.init=megatron"], "model.init='megatron' with model.megatron_path='': init=megatron starts from"),
    (["model.megatron_path=runs/x"], "with model.megatron_path='runs/x': init=megatron starts from"),
    (["model.init=megatron", "model.megatron_path=/nonexistent"],
     "model.megatron_path=/nonexistent: /nonexistent: not a megatron checkpoint"),
    (["distill.teacher_path=/nonexistent/teacher"], "distill.teacher_path=/nonexistent/teacher: "),
    (["distill.teacher_path=megatron_offgrpo/assets/tiny-qwen2"], "distill.teacher_path=megatron_offgrpo/assets/"
     "tiny-qwen2: "),  # a config without weights
    (["distill.teacher_path=t", "distill.weight=0"], "distill.weight=0.0, distill.reward_weight=0.0: both 0 leaves"),
    (["distill.weight=0.5"], "distill.weight=0.5 without a teacher: it sets how the run distills, which needs "
     "distill.teacher_path (or distill.teacher_fleet)"),
    (["distill.teacher_path=t", "distill.teacher_fleet=f"], "give one teacher"),
    (["distill.teacher_fleet=f", "rollout.temperature=0.7"],
     "distill.teacher_fleet with rollout.temperature=0.7: a fleet scores the teacher at temperature 1"),
    (["distill.teacher_fleet=/nonexistent/fleet"],
     "distill.teacher_fleet=/nonexistent/fleet: /nonexistent/fleet/fleet.json: no fleet state"),
    (["env.max_turns=0"], "env.max_turns=0, env.max_tokens=None: must be >= 1"),
    (["env.name=chess"], "env.name='chess': expected one of ['feedback', 'python_tool']"),
    (["env.name=os:system"], "env.name='os:system' cannot be called with no arguments (it takes command)"),
    (["env.name=os:getcwd"], "env.name='os:getcwd' made str, not an Environment"),  # probed before the run dir
    (["env.max_turns=6"], "env.max_turns=6 does nothing without env.name (single-turn completions)"),
    (["env.name=feedback", "env.tool_wall_s=3"], "env.tool_wall_s=3.0 applies to env.name=python_tool only"),
    (["env.name=feedback", "env.step_timeout_s=0"], "env.step_timeout_s=0.0: must be > 0"),
    (["lora.rank=-1"], "lora.rank=-1: must be >= 0 (0: full fine-tuning)"),
    (["lora.alpha=16"], "lora.alpha=16.0 does nothing with lora.rank=0 (full fine-tuning)"),
    (["lora.rank=4", "lora.dropout=1"], "lora.dropout=1.0: must be in [0, 1)"),
    (["lora.rank=4", "lora.targets=[linear_fc3]"], "lora.targets=['linear_fc3']: unknown ['linear_fc3']; valid: "),
    (["lora.rank=4", "lora.sync=delta"], "lora.sync='delta': expected one of ['adapter', 'merged']"),
    (["rollout.sync=delta", "rollout.engine=transformers"], "rollout.sync=delta with rollout.engine=transformers: "
     "deltas need vLLM"),
    (["rollout.sync=delta", "rollout.engine=vllm", "lora.rank=4"], "rollout.sync=delta with lora.sync=adapter: "
     "deltas are of whole weights"),
    (["rollout.sync=delta", "rollout.engine=fleet", "rollout.fleet_state=/tmp"], "rollout.sync=delta with "
     "rollout.engine=fleet: set rollout.dtype"),
    (["rollout.full_sync_every=0"], "rollout.full_sync_every=0: must be >= 1"),
    (["rollout.sync=xor"], "rollout.sync"),
    (["lora.rank=4", "rollout.engine=transformers"], "lora.sync=adapter with rollout.engine=transformers: the "
     "engines load the adapter with vLLM's LoRA"),
    (["lora.rank=4", "model.hf_path=megatron_offgrpo/assets/tiny-qwen3-moe", "lora.targets=[linear_qkv,linear_fc1]"],
     "a Qwen3-MoE layer's MLP is its experts, and adapters on experts"),
]


def test_the_warm_up_refuses_adapters(tmp_path, capsys):
    out = tmp_path / "run"
    code, err = _run(["sft", "--config", TINY, f"train.out_dir={out}", "lora.rank=4"], capsys)
    assert code == 2 and "lora.rank=4: offgrpo sft trains the whole model" in err and not out.exists()


def _run(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return exit_.value.code, capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "sft", "eval"])
@pytest.mark.parametrize("overrides, message", CASES, ids=[c[0][0] for c in CASES])
def test_bad_value_is_one_line_and_exit_2(command, overrides, message, tmp_path, capsys):
    out = tmp_path / "run"
    code, err = _run([command, "--config", TINY, f"train.out_dir={out}", *overrides], capsys)
    assert code == 2 and message in err, err
    assert "Traceback" not in err and err.startswith("error: ")
    assert all(line.startswith(("error: ", "  ")) for line in err.splitlines())  # one line per error, indented
    assert not out.exists()  # nothing written: the check ran before any run directory


@pytest.mark.parametrize("overrides, lines", [
    (["distill.teacher_path=t", "distill.discount=1.5"], ["distill.discount=1.5: must be in [0, 1]"]),
    (["distill.teacher_fleet=f", "distill.reward_weight=-2"], ["distill.reward_weight=-2.0: must be >= 0"]),
    (["distill.teacher_path=t", "distill.weight=-1", "distill.reward_weight=1"], ["distill.weight=-1.0: must be >= 0"]),
    (["distill.teacher_path=''"], ["distill.teacher_path='': empty; give the teacher"]),
    (["distill.reward_weight=1", "distill.discount=0.5"], ["distill.reward_weight=1.0 without a teacher",
                                                           "distill.discount=0.5 without a teacher"]),
    (["distill.teacher_path=t", "distill.weight=1", "distill.reward_weight=1", "distill.discount=1"], []),
    (["distill.weight=1.0", "distill.reward_weight=0", "distill.discount=0"], []),  # the defaults: nothing ignored
])
def test_a_distill_error_names_only_the_broken_rule_with_its_values(overrides, lines):
    """One line per broken ``distill.*`` rule (no list of every rule), each starting with the values given."""
    try:
        load_config(TINY, overrides)
        errors = []
    except ValueError as exc:
        errors = str(exc).splitlines()[1:]
    assert len(errors) == len(lines) and all(e.strip().startswith(line) for e, line in zip(errors, lines)), errors


@pytest.mark.parametrize("overrides, message", [
    (["env.name=nosuch"], "env.name='nosuch': expected one of ['feedback', 'python_tool'] or 'package.module:Factory'"),
    (["env.name=os:system"], "env.name='os:system' cannot be called with no arguments"),
    (["env.step_timeout_s=5"], "env.step_timeout_s=5.0 does nothing without env.name"),
])
def test_config_refuses_the_environments_train_refuses(overrides, message, capsys):
    """``offgrpo config`` runs the same validation as train and eval: one line, exit 2."""
    code, err = _run(["config", "--config", TINY, *overrides], capsys)
    assert code == 2 and message in err and "Traceback" not in err, err


def test_every_error_is_reported_at_once(tmp_path, capsys):
    code, err = _run(["train", "--config", TINY, "optim.lr=-1", "data.count=0", "optim.adam_beta2=2"], capsys)
    assert code == 2 and all(k in err for k in ("optim.lr=", "data.count=", "optim.adam_beta2="))


@pytest.mark.parametrize("text, message", [
    ("model: {hf_path: x\n", "not valid YAML at line 2"),
    ("- just\n- a list\n", "a recipe is a mapping of sections, got list"),
    ("model: 3\n", "model is a section; give its keys"),
])
def test_a_broken_recipe_is_one_line(text, message, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    code, err = _run(["sft", "--config", str(recipe)], capsys)
    assert code == 2 and message in err and "Traceback" not in err and len(err.splitlines()) == 1, err


_BASE = ("model: {hf_path: megatron_offgrpo/assets/tiny-qwen2, init: random}\n"
         "train: {steps: 2, out_dir: OUT}\n")


@pytest.mark.parametrize("command", ["train", "sft", "eval"])
@pytest.mark.parametrize("tail, line, key, first", [
    ("train: {steps: 3}\n", 3, "train", 2),  # a trailing section would replace the first one whole
    ("rollout: {group_size: 4}\nrollout: {group_size: 8}\n", 4, "rollout", 3),
    ("rollout: {group_size: 4, max_new_tokens: 8, group_size: 2}\n", 3, "group_size", 3),  # in a flow mapping
    ("optim:\n  lr: 1.0e-3\n  clip_grad: 1.0\n  lr: 2.0e-3\n", 6, "lr", 4),  # in a block mapping
    ("data: {name: arithmetic}\n\"data\": {count: 4}\n", 4, "data", 3),  # quoting does not make a new key
], ids=["section", "section-again", "flow-key", "block-key", "quoted"])
def test_a_duplicated_key_is_one_line_naming_file_line_and_key(command, tail, line, key, first, tmp_path, capsys):
    out = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(_BASE.replace("OUT", str(out)) + tail)
    code, err = _run([command, "--config", str(recipe)], capsys)
    assert code == 2 and "Traceback" not in err, err
    assert err.splitlines()[-1].strip() == (
        f"error: {recipe}: line {line}: key {key!r} is given twice (first at line {first}); "
        "the later one would silently replace the first: merge them"), err
    assert len(err.splitlines()) == 1 and not out.exists()  # refused before any run directory


@pytest.mark.parametrize("text, expect", [
    ("a: {b: {c: 1, c: 2}}\n", "line 1: key 'c' is given twice"),  # any depth
    ("a:\n  b:\n    - {c: 1}\n    - {d: 1, d: 2}\n", "line 4: key 'd' is given twice"),  # inside a list
    ("1: x\n'1': y\n", {1: "x", "1": "y"}),  # an int and a string are two keys
    # an explicit key may override what a YAML merge brought in (that is what a merge is for), and two merges add up
    ("optim: {<<: {lr: 0.5, clip_grad: 2.0}, lr: 0.25}\n", {"optim": {"lr": 0.25, "clip_grad": 2.0}}),
    ("optim:\n  <<: {lr: 0.5}\n  <<: {clip_grad: 2.0}\n", {"optim": {"lr": 0.5, "clip_grad": 2.0}}),
], ids=["deep", "in-list", "int-and-str", "merge-override", "two-merges"])
def test_the_loader_refuses_duplicates_at_any_depth_and_keeps_merges(text, expect, tmp_path):
    from megatron_offgrpo.config._load import read_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    if isinstance(expect, str):
        with pytest.raises(ConfigError, match=f"^{recipe}: {expect}"):
            read_recipe(recipe)
    else:
        assert read_recipe(recipe) == expect


def test_a_missing_recipe_is_one_line(tmp_path, capsys):
    code, err = _run(["train", "--config", str(tmp_path / "none.yaml")], capsys)
    assert code == 2 and f"config recipe {tmp_path / 'none.yaml'} not found" in err


_KEYS = [f"{s}.{f}" for s, section in vars(Config()).items() for f in vars(section)]
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.integers(), st.floats(allow_nan=True),
                    st.text(max_size=12), st.lists(st.integers(), max_size=3))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.sampled_from(_KEYS), st.text(max_size=15)), _VALUES), max_size=4))
@example(pairs=[("rollout.prompts_per_step", 1.4044477616111843e+306)])  # once overflowed float() in a rule
@example(pairs=[("rollout.max_new_tokens", 2**63), ("rollout.group_size", 2**62)])
def test_the_loader_only_ever_raises_config_errors(pairs):
    overrides = [f"{key}={value}" for key, value in pairs]
    try:
        load_config(REPO / "configs" / "tiny-cpu.yaml", overrides)
    except (ConfigError, ValueError):
        pass  # ConfigError is a ValueError; anything else (TypeError, AttributeError, ...) fails the test


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_any_recipe_text_loads_or_is_a_config_error(tmp_path_factory, text):
    recipe = tmp_path_factory.mktemp("r") / "r.yaml"
    recipe.write_text(text)
    try:
        load_config(recipe)
    except (ConfigError, ValueError):
        pass


def test_eval_names_a_missing_model_flag(capsys):
    code, err = _run(["eval", "--config", TINY, "--model", "/nonexistent/hf"], capsys)
    assert code == 2 and "--model=/nonexistent/hf: " in err and "Traceback" not in err


@pytest.mark.parametrize("flag, message", [
    (["--engine", "bogus"], "rollout.engine='bogus': expected one of"),
    (["--prompts", "0"], "train.eval_prompts=0: must be >= 1"),
])
def test_eval_flags_are_validated_like_keys(flag, message, capsys):
    code, err = _run(["eval", "--config", TINY, *flag], capsys)
    assert code == 2 and message in err and "Traceback" not in err, err


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_named_tracker_that_is_not_installed_is_one_line_naming_the_extra(command, tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    out = tmp_path / "run"
    code, err = _run([command, "--config", TINY, f"train.out_dir={out}", "train.loggers=[tensorboard,wandb]"], capsys)
    assert code == 2 and "train.loggers: wandb is not installed (pip install 'megatron-offgrpo[tracking]')" in err
    assert len(err.splitlines()) == 2 and not out.exists()  # "invalid config:" and the one line


@pytest.mark.parametrize("layout", [["optim.packing=true"], ["optim.packing=true", "optim.shared_prompt=true"]],
                         ids=["packing", "shared-prompt"])
def test_packed_rows_with_transformer_engine_are_one_line(tmp_path, capsys, monkeypatch, layout):
    import megatron_offgrpo.runtime

    monkeypatch.setattr(megatron_offgrpo.runtime, "have_te", lambda: True)  # as on a GPU node with TE
    out = tmp_path / "run"
    code, err = _run(["train", "--config", TINY, f"train.out_dir={out}", *layout], capsys)
    assert code == 2 and f"{' and '.join(layout)} need the local layer spec" in err, err
    assert len(err.splitlines()) == 2 and not out.exists()


# --- output paths and run records of the other commands (issue 35) ---

def _metrics_run(tmp_path, *lines: str):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return run


GOOD = '{"step": 0, "wall_s": 1.0, "reward_mean": 0.5}'
REPORT_CASES = [  # (records, what the one line must say)
    ([GOOD, '{"wall_s": 2.0, "reward_mean": 0.5}'], "metrics.jsonl:2: the record has no step"),
    ([GOOD, '{"step": "one", "wall_s": 2.0}'], "metrics.jsonl:2: the record step='one' is not a step number"),
    ([GOOD, '{"step": 1.5, "wall_s": 2.0}'], "metrics.jsonl:2: the record step=1.5 is not a step number"),
    ([GOOD, '{"step": 1, "wall_s": "late"}'], "metrics.jsonl:2: wall_s='late' is not a number"),
    (['{"step": 0, "wall_s": 1.0', GOOD], "metrics.jsonl:1: not a JSON record (Expecting ',' delimiter, column 26)"),
    (["[]", GOOD], "metrics.jsonl:1: a JSON list, not a record"),
]


@pytest.mark.parametrize("records, message", REPORT_CASES, ids=[c[1].split(": ", 1)[1][:30] for c in REPORT_CASES])
def test_report_names_the_file_and_line_of_a_bad_record(records, message, tmp_path, capsys):
    run = _metrics_run(tmp_path, *records)
    code, err = _run(["report", str(run)], capsys)
    assert code == 2 and err.startswith(f"error: {run / message}") and len(err.splitlines()) == 1, err
    assert not (run / "report.png").exists()


def test_report_skips_a_torn_last_line_and_a_non_numeric_metric_saying_where(tmp_path, capsys, caplog):
    pytest.importorskip("matplotlib")
    run = _metrics_run(tmp_path, GOOD, '{"step": 1, "wall_s": 2.0, "reward_mean": "high"}')
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "wa')  # a run killed while writing its step 2
    code, _ = _run(["report", str(run)], capsys)
    assert code == 0 and (run / "report.png").is_file()
    assert f"{run}/metrics.jsonl:2: reward_mean='high': not a number, skipped" in caplog.text
    assert f"{run}/metrics.jsonl:3: a torn last record (the run stopped while writing it): skipped" in caplog.text


@pytest.mark.parametrize("case", ["directory", "missing-dir", "under-a-file", "long-name"])
def test_eval_out_is_checked_before_the_evaluation(case, tmp_path, capsys, monkeypatch):
    (tmp_path / "a-file").write_text("x")
    out, message = {
        "directory": (tmp_path, f"is a directory: name the file to write, e.g. --out {tmp_path / 'eval.json'}"),
        "missing-dir": (tmp_path / "nope" / "r.json", f"its directory {tmp_path / 'nope'} does not exist: create it"),
        "under-a-file": (tmp_path / "a-file" / "r.json", f"its directory {tmp_path / 'a-file'} "),
        "long-name": (tmp_path / ("y" * 300 + ".json"), "bytes, over the 255 a file name may have"),
    }[case]
    import megatron_offgrpo.sampler as sampler_room

    monkeypatch.setattr(sampler_room, "evaluate", lambda *a, **k: pytest.fail("evaluated before --out was checked"),
                        raising=False)
    code, err = _run(["eval", "--config", TINY, "--out", str(out)], capsys)
    assert code == 2 and err.startswith(f"error: --out {out}: ") and message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("case", ["a-file", "under-a-file", "read-only"])
def test_recipes_into_an_unwritable_place_is_one_line(case, tmp_path, capsys):
    import os

    (tmp_path / "a-file").write_text("x")
    if case == "read-only":
        if os.geteuid() == 0:  # root writes through any mode bits: a place the kernel refuses (sysfs) instead
            dest = __import__("pathlib").Path("/sys/offgrpo-recipes")
        else:
            (tmp_path / "ro").mkdir(mode=0o500)
            dest = tmp_path / "ro" / "recipes"
        message = f"error: {dest}: "
    else:
        dest = tmp_path / "a-file" / ("sub" if case == "under-a-file" else "")
        dest = dest if case == "under-a-file" else tmp_path / "a-file"
        message = (f"error: {dest}: Not a directory: " if case == "under-a-file"
                   else f"error: {dest} is a file: DIR is where configs/ and launch/ go")
    code, err = _run(["recipes", str(dest)], capsys)
    assert code == 2 and err.startswith(message) and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert (tmp_path / "a-file").read_text() == "x"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A real tiny Qwen2 HF directory (the bundled config, random weights), saved once."""
    from tests.helpers import save_hf_model

    config = dict(json.loads((ASSET / "config.json").read_text()), vocab_size=1024)  # small: copied per case
    return save_hf_model(config, tmp_path_factory.mktemp("models") / "good", seed=1)


def _edit_config(directory, **fields):
    config = json.loads((directory / "config.json").read_text())
    config.update(fields)
    (directory / "config.json").write_text(json.dumps(config))


def _no_weights(d):
    (d / "model.safetensors").unlink()


def _cut_in_half(d):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _tokenizer_without_vocab(d):  # tokenizer_config.json and friends, but no vocab.json / merges.txt
    for f in (REPO / "megatron_offgrpo" / "assets" / "qwen2-tokenizer").iterdir():
        if f.name not in ("vocab.json", "merges.txt", "SOURCES.md"):
            shutil.copy(f, d / f.name)


ASSET = REPO / "megatron_offgrpo" / "assets" / "tiny-qwen2"
MODEL_DIR_CASES = [  # (break the copy of a good model directory, what the one line must say after "{key}={dir}: ")
    (_no_weights, "{dir}: no *.safetensors weights and no model.safetensors.index.json"),
    (_cut_in_half, "{dir}/model.safetensors: truncated safetensors file: data section needs "),
    (lambda d: _edit_config(d, intermediate_size=1024), "weights do not match its config.json: model.safetensors: "
     "model.layers.0.mlp.gate_proj.weight has shape [384, 128], config.json gives [1024, 128]"),
    (lambda d: _edit_config(d, num_hidden_layers=-1), "num_hidden_layers=-1 (must be a whole number >= 1)"),
    (lambda d: _edit_config(d, hidden_size=0, vocab_size="many"),
     "vocab_size='many' (must be a whole number >= 1); hidden_size=0 (must be a whole number >= 1)"),
    (_tokenizer_without_vocab, "its tokenizer encodes 'What is 2 + 3?' to no tokens"),
]


@pytest.mark.parametrize("command", ["train", "eval"])
@pytest.mark.parametrize("breaks, message", MODEL_DIR_CASES,
                         ids=["no-weights", "cut-in-half", "shapes", "layers-1", "sizes", "tokenizer"])
def test_a_broken_model_directory_is_one_line(command, breaks, message, tmp_path, tiny_model, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    breaks(model)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    out = tmp_path / "run"
    flags = (["--model", str(model)] if command == "eval" else [f"model.hf_path={model}", "model.init=hf"])
    code, err = _run([command, "--config", TINY, f"train.out_dir={out}", *flags], capsys)
    key = "--model" if command == "eval" else "model.hf_path"
    assert code == 2 and err.startswith(f"error: invalid config:\n  {key}={model}: "), err
    assert message.format(dir=model) in err and len(err.splitlines()) == 2 and "Traceback" not in err, err
    assert not out.exists() and {p.name: p.read_bytes() for p in model.iterdir()} == before  # nothing written


def _tokenizer_copy(directory, vocab=None, added=None, merges=None):
    """The bundled Qwen2.5 tokenizer's files copied into ``directory``, edited: ``vocab`` and ``added`` map a token to
    its new id (None: drop the added token), ``merges`` swaps two merge lines (their index after the header)."""
    directory.mkdir(exist_ok=True)
    for f in TOKENIZER_DIR.iterdir():
        if f.name != "SOURCES.md":
            shutil.copy(f, directory / f.name)
    ids = json.loads((directory / "vocab.json").read_text())
    (directory / "vocab.json").write_text(json.dumps({**ids, **(vocab or {})}, ensure_ascii=False))
    added_ids = {**json.loads((directory / "added_tokens.json").read_text()), **(added or {})}
    (directory / "added_tokens.json").write_text(json.dumps({t: i for t, i in added_ids.items() if i is not None}))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    entry = next(iter(config["added_tokens_decoder"].values()))
    config["added_tokens_decoder"] = {str(i): dict(entry, content=t) for t, i in added_ids.items() if i is not None}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    if merges is not None:
        lines = (directory / "merges.txt").read_text(encoding="utf-8").split("\n")
        a, b = merges[0] + 1, merges[1] + 1  # the "#version" header first
        lines[a], lines[b] = lines[b], lines[a]
        (directory / "merges.txt").write_text("\n".join(lines), encoding="utf-8")
    return directory


@pytest.mark.parametrize("edit, difference", [
    (dict(vocab={"Ġthe": 8251, "Ġcat": 279}),
     "token 'Ġthe' (text ' the') is id 279 in the policy, 8251 in the teacher"),
    (dict(added={"<|im_start|>": 151645, "<|im_end|>": 151644}),
     "token '<|im_start|>' is id 151644 in the policy, 151645 in the teacher"),
    (dict(merges=(5, 9)), "its BPE merge #5 differs: "),
    (dict(added={"<think>": 151665}), None),  # a teacher's extra token after the policy's: never asked about
])
def test_a_teachers_tokenizer_is_compared_token_by_token(edit, difference, tmp_path):
    """A real tokenizer (the bundled Qwen2.5 one) copied and edited: the first id, added token or merge that differs
    is named; a teacher that only adds tokens after the policy's numbers every policy token alike."""
    from megatron_offgrpo.model import load_tokenizer
    from megatron_offgrpo.model._tokenizer_diff import tokenizer_difference

    got = tokenizer_difference(ASSET, _tokenizer_copy(tmp_path / "teacher", **edit), load_tokenizer)
    bundled = "; the policy has no tokenizer of its own (the bundled Qwen2.5 one stands for it)"
    assert got is None if difference is None else got.startswith(difference) and got.endswith(bundled), got


@pytest.mark.parametrize("where", ["teacher_path", "teacher_fleet"])
def test_a_teacher_with_another_tokenizer_is_one_line(where, tmp_path, tiny_model, capsys):
    """``distill.teacher_path``, or the model directory a teacher's fleet serves (its recorded state): a teacher whose
    tokenizer lacks one of the policy's tokens is refused before anything runs, naming the token."""
    from megatron_offgrpo.fleet import FleetState, records

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_model, teacher)
    _tokenizer_copy(teacher, added={"<|file_sep|>": None})
    value, key = teacher, f"distill.teacher_path={teacher}"
    if where == "teacher_fleet":  # the record `offgrpo fleet start` writes; preflight reads it, asks no server
        server = records.ServerRecord("s0@127.0.0.1:8100", "http://127.0.0.1:8100", 8100)  # recorded, never started
        value = FleetState(str(teacher), "teacher", None, [server]).write(tmp_path / "fleet").parent
        key = f"distill.teacher_fleet={value} (serving {teacher})"
    out = tmp_path / "run"
    code, err = _run(["train", "--config", TINY, f"train.out_dir={out}", f"model.hf_path={tiny_model}",
                      "model.init=hf", "rollout.temperature=1", f"distill.{where}={value}"], capsys)
    assert code == 2 and err.splitlines() == ["error: invalid config:", (
        f"  {key}: its tokenizer differs from the policy's (model.hf_path={tiny_model}): token '<|file_sep|>' is id "
        "151664 in the policy, absent from the teacher's vocabulary; the policy has no tokenizer of its own (the "
        "bundled Qwen2.5 one stands for it); the model scores the policy's token ids, so it needs the policy's "
        "tokenizer (the same ids for the same tokens)")], err
    assert not out.exists()


@pytest.mark.parametrize("command", ["train", "sft", "eval"])
def test_a_sequence_over_the_models_positions_is_refused_not_capped(command, tmp_path, capsys):
    out = tmp_path / "run"
    code, err = _run([command, "--config", TINY, f"train.out_dir={out}", "rollout.max_new_tokens=100000"], capsys)
    line = ("rollout.max_new_tokens=100000: a prompt and its completion must fit the model's "
            "max_position_embeddings=512 (megatron_offgrpo/assets/tiny-qwen2): lower rollout.max_new_tokens to at most "
            "512 minus the longest prompt's tokens")
    assert code == 2 and line in err and "Traceback" not in err, err
    assert not out.exists()


def test_resume_with_a_model_of_other_shapes_names_both(tmp_path, capsys):
    """The checkpoint's model card (as the trainer writes it) holds a narrower MLP than ``model.hf_path`` gives."""
    from checkpoint_tools import dist_ckpt

    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    checkpoint.mkdir(parents=True)
    hf_config = dict(json.loads((ASSET / "config.json").read_text()), intermediate_size=256)
    dist_ckpt.write_model_card(checkpoint, dist_ckpt.DistModelCard(hf_config, "float32", {"tp": 1, "pp": 1, "dp": 1}))
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 2}))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "run").rglob("*"))
    code, err = _run(["train", "--config", TINY, f"train.out_dir={tmp_path / 'run'}", "--resume"], capsys)
    assert code == 2 and err.splitlines()[-1] == (
        f"  --resume: {checkpoint} holds model.layers.0.mlp.gate_proj.weight of shape [256, 128], "
        "model.hf_path=megatron_offgrpo/assets/tiny-qwen2 gives [384, 128]: resume with the model the run started "
        "from, or start a new train.out_dir"), err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "run").rglob("*")) == before  # untouched


def test_a_megatron_checkpoint_of_another_model_names_both_shapes(tmp_path, capsys):
    """``model.init=megatron`` from a checkpoint whose model card holds a narrower MLP than ``model.hf_path``."""
    from checkpoint_tools import dist_ckpt

    release = tmp_path / "megatron" / "release"
    release.mkdir(parents=True)
    (release / "metadata.json").write_text("{}")
    (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").write_text("release")
    hf_config = dict(json.loads((ASSET / "config.json").read_text()), intermediate_size=256)
    dist_ckpt.write_model_card(release, dist_ckpt.DistModelCard(hf_config, "float32", {"tp": 1, "pp": 1, "dp": 1}))
    code, err = _run(["train", "--config", TINY, f"train.out_dir={tmp_path / 'run'}", "model.init=megatron",
                      f"model.megatron_path={tmp_path / 'megatron'}"], capsys)
    assert code == 2 and err.splitlines()[-1] == (
        f"  model.megatron_path={tmp_path / 'megatron'}: {release} holds model.layers.0.mlp.gate_proj.weight of "
        "shape [256, 128], model.hf_path=megatron_offgrpo/assets/tiny-qwen2 gives [384, 128]: give the "
        "model.hf_path it was converted from"), err
    assert not (tmp_path / "run").exists()


def test_the_longest_prompt_and_its_completion_must_fit_the_positions():
    """Once the prompts are tokenized (before any engine starts), the longest one plus ``rollout.max_new_tokens`` is
    checked against the model's positions: the engine would otherwise cap those completions short, silently."""
    from megatron_offgrpo.model import load_tokenizer
    from megatron_offgrpo.sampler import load_prompts
    from megatron_offgrpo.sampler._prompts import prompt_length_error

    config = load_config(TINY, ["rollout.max_new_tokens=500"])
    prompts = load_prompts(config, load_tokenizer(config.model.hf_path), config.data.split)
    longest = max(len(p.prompt_ids) for p in prompts)
    assert prompt_length_error(prompts, config, 500 + longest, "train") is None
    assert prompt_length_error(prompts, config, 499 + longest, "train") == (
        f"rollout.max_new_tokens=500: the longest prompt of data split 'train' has {longest} tokens, so a sequence "
        f"reaches {500 + longest}, over the model's max_position_embeddings={499 + longest}: lower "
        f"rollout.max_new_tokens to <= 499 (or data.max_prompt_tokens)")


@pytest.mark.parametrize("command, overrides, world, need", [
    ("train", ["parallel.tp=2"], None, 2),  # the README's torchrun command, run without torchrun
    ("sft", ["parallel.pp=2"], "3", 2),  # under torchrun, a process count the layout does not divide
    ("train", ["model.hf_path=megatron_offgrpo/assets/tiny-qwen3-moe", "parallel.ep=2", "parallel.etp=1"], None, 2),
])
def test_a_layout_over_the_jobs_processes_names_the_torchrun_command(command, overrides, world, need, tmp_path,
                                                                     capsys, monkeypatch):
    """Refused before the run directory exists (megatron's own refusal came after train.log was written), with the
    command that launches enough processes."""
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    out = tmp_path / "run"
    argv = ["--config", TINY, f"train.out_dir={out}", *overrides]
    code, err = _run([command, *argv], capsys)
    module = "megatron_offgrpo.train" if command == "train" else "megatron_offgrpo.cli sft"
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 2, err
    assert f"needs a multiple of {need} processes" in err and "--nproc_per_node=" in err, err
    assert f"`torchrun --nproc_per_node={need} -m {module} --config {TINY} train.out_dir={out} " in err, err
    assert not out.exists()


def test_eval_builds_no_megatron_model_so_any_layout_is_fine(tmp_path, capsys, monkeypatch):
    from megatron_offgrpo.preflight._checks import world_errors

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = load_config(TINY, ["parallel.tp=2", "parallel.pp=2"])
    assert "--nproc_per_node=4 -m x" in world_errors(config, ["-m", "x"])[0]
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert world_errors(config, ["-m", "x"]) == []  # DP 2


LONG_NAME = "n" * 300  # over the 255 bytes a path component may have


@pytest.mark.parametrize("command", ["train", "eval"])
@pytest.mark.parametrize("key", ["model.hf_path", "data.path", "data.eval_path", "model.megatron_path",
                                 "distill.teacher_path", "train.out_dir", "--config", "--model"])
def test_a_path_component_over_255_bytes_is_one_line_naming_the_key(command, key, tmp_path, capsys):
    long = str(tmp_path / LONG_NAME / "x")
    if (key == "--model") != (command == "eval") and key in ("--model", "train.out_dir"):
        pytest.skip("--model is eval's flag; eval writes no run directory")
    out = tmp_path / "run"
    argv = ["--config", long if key == "--config" else TINY, f"train.out_dir={long if key == 'train.out_dir' else out}"]
    argv += [] if key in ("--config", "train.out_dir") else [key, long] if key == "--model" else [f"{key}={long}"]
    argv += ["model.init=megatron"] if key == "model.megatron_path" else []
    code, err = _run([command, *argv], capsys)
    assert code == 2 and "Traceback" not in err and "is 300 bytes, over the 255 a file name may have" in err, err
    name = "config recipe" if key == "--config" else key
    assert f"{name}={long}" in err or f"{name} {long}" in err, err
    assert len(err.splitlines()) <= 2 and not out.exists(), err


def test_a_path_over_the_systems_length_limit_is_one_line(tmp_path, capsys):
    """Every component short, the whole path over PATH_MAX (4096): the filesystem's own error, named by key."""
    deep = str(tmp_path / "/".join(["d" * 200] * 25) / "f.jsonl")
    for argv, key in ((["eval", f"data.path={deep}"], "data.path"), (["eval", "--model", deep], "--model"),
                      (["sft", f"train.out_dir={deep}"], "train.out_dir")):
        code, err = _run([argv[0], "--config", TINY, *argv[1:]], capsys)
        assert code == 2 and "Traceback" not in err and f"{key}={deep}" in err and "File name too long" in err, err


REWARD_CASES = [  # (reward keys, with {rm} / {lm} for a classifier / causal LM directory; the line's text)
    (["reward.model={lm}"], "reward.model={lm}: a Qwen2ForCausalLM; a scalar reward model is a sequence "
     "classifier with one label"),
    (["reward.judge={rm}"], "reward.judge={rm}: a Qwen2ForSequenceClassification; a judge is a causal LM that replies"),
    (["reward.model=/nonexistent/rm"], "reward.model=/nonexistent/rm: "),
    (["reward.judge={lm}", "reward.judge_template=likert"], "reward.judge_template='likert': neither a builtin"),
    (["reward.model={rm}", "reward.judge={lm}"], "give one (a scalar reward model, or a generative judge)"),
    (["reward.clip=2"], "reward.clip=2.0 without reward.model or reward.judge"),
    (["reward.model={rm}", "reward.unparsed=resample"], "reward.unparsed=resample with a scalar reward model"),
    (["reward.model={rm}", "reward.rule_weight=0", "reward.model_weight=0"], "every reward would be 0"),
    (["reward.model={rm}", "env.name=feedback"], "models score single-turn completions"),
    (["reward.model={rm}", "reward.fleet={rm}"], "reward.fleet={rm}: "),
]


@pytest.mark.parametrize("keys, message", REWARD_CASES, ids=[c[1][:40] for c in REWARD_CASES])
def test_a_reward_model_that_cannot_score_is_one_line(keys, message, tmp_path, capsys, tiny_model):
    from tests.reward.models import classifier_dir

    rm = classifier_dir(tmp_path / "rm")
    names = {"rm": rm, "lm": tiny_model}
    out = tmp_path / "run"
    code, err = _run(["train", "--config", TINY.replace("-sft", ""), f"train.out_dir={out}",
                      f"model.hf_path={tiny_model}", "model.init=hf", *[k.format(**names) for k in keys]], capsys)
    assert code == 2 and message.format(**names) in err and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if line.startswith("  ")]) == 1, err
    assert not out.exists()
