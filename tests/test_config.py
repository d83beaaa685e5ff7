"""The config tree: every recipe under configs/ validates; overrides are typed; every error names its key."""

from __future__ import annotations

import dataclasses
import inspect
import functools

import pytest

from megatron_offgrpo.config import Config, ConfigError, load_config, parse_override
from tests.helpers import REPO

RECIPES = sorted((REPO / "configs").rglob("*.yaml"))


def test_there_are_recipes():
    assert {p.name for p in RECIPES} >= {"tiny-cpu.yaml", "qwen2.5-0.5b-gsm8k.yaml", "qwen2.5-7b-gsm8k-fp8.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_validates_and_opens_with_a_header(recipe):
    config = load_config(recipe)
    assert isinstance(config, Config)
    lines = recipe.read_text().splitlines()
    comments = lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))]
    keys = [line.split(":")[0] for line in comments if line[2:3] != " "]
    assert keys == ["# Recipe", "# Download", "# Launch", "# Override"]


def test_overrides_are_typed():
    config = load_config(REPO / "configs" / "tiny-cpu.yaml", [
        "rollout.refresh_every=4", "algo.dual_clip=3", "optim.lr=5e-5", "train.deterministic=false",
        "rollout.fleet_state=runs/fleet", "algo.tis_cap=null",
    ])
    assert config.rollout.refresh_every == 4 and config.algo.dual_clip == 3.0 and config.optim.lr == 5e-5
    assert config.train.deterministic is False and config.rollout.fleet_state == "runs/fleet"
    assert config.algo.tis_cap is None
    assert parse_override("a.b.c=1") == {"a": {"b": {"c": 1}}}


@pytest.mark.parametrize("override, loggers", [
    ("train.loggers=[tensorboard,wandb]", ["tensorboard", "wandb"]),  # a YAML list
    ("train.loggers=wandb, mlflow", ["wandb", "mlflow"]),  # comma-separated
    ("train.loggers=[]", []), ("train.loggers=", []),  # metrics.jsonl only
])
def test_tracking_keys_are_typed(override, loggers):
    config = load_config(REPO / "configs" / "tiny-cpu.yaml", [override, "train.run_name=exp-1", "train.samples_every=0",
                                                               "train.project=p"])
    assert config.train.loggers == loggers and config.train.run_name == "exp-1" and config.train.samples_every == 0
    assert config.train.project == "p" and Config().train.loggers == ["tensorboard"] and Config().train.run_name is None
    with pytest.raises(ConfigError, match="train.loggers=3: expected list"):
        load_config(None, ["train.loggers=3"])


@pytest.mark.parametrize(
    "override,message",
    [
        ("rollout.gruop_size=3", "unknown config key 'rollout.gruop_size'"),
        ("optim.lr=fast", "optim.lr='fast': expected float"),
        ("parallel.tp=1.5", "parallel.tp=1.5: expected int"),
        ("train.resume=maybe", "train.resume='maybe': expected bool"),
        ("rollout", "is not key=value"),
        ("model=3", "model is a section"),
    ],
)
def test_type_and_key_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(REPO / "configs" / "tiny-cpu.yaml", [override])


@pytest.mark.parametrize("old, value, new", [("overlap", "true", "rollout.mode=overlap"),
                                             ("partial_rollouts", "true", "rollout.mode=async_partial")])
def test_a_key_folded_into_rollout_mode_is_refused_with_its_new_spelling(old, value, new, tmp_path):
    """In an override or a recipe: one line naming the new spelling, not the list of valid keys."""
    recipe = tmp_path / "old.yaml"
    recipe.write_text(f"rollout:\n  mode: async\n  {old}: {value}\n")
    for path, overrides in ((None, [f"rollout.{old}={value}"]), (recipe, [])):
        with pytest.raises(ConfigError) as refused:
            load_config(path, overrides)
        assert str(refused.value).startswith(f"rollout.{old} is now {new} (") and "\n" not in str(refused.value)


def test_all_cross_field_errors_are_reported_together():
    with pytest.raises(ValueError) as err:
        load_config(None, ["rollout.group_size=1", "rollout.engine=fleet", "algo.objective=gpg", "algo.dual_clip=2",
                           "rollout.transport=carrier-pigeon", "parallel.tp=0"])
    text = str(err.value)
    for fragment in ("model.hf_path is empty", "rollout.group_size=1", "rollout.fleet_state", "dual_clip=2.0",
                     "rollout.transport='carrier-pigeon'", "parallel.tp=0: must be >= 1"):
        assert fragment in text, fragment


def test_every_field_has_a_docstring():
    for section in dataclasses.fields(Config):
        value = getattr(Config(), section.name)
        source = inspect.getsource(type(value))  # the classes of config/_tree.py and config/_sections.py
        for field in dataclasses.fields(value):
            assert f"    {field.name}:" in source
            after = source.split(f"    {field.name}:", 1)[1].splitlines()[1].strip()
            assert after.startswith('"""'), f"{section.name}.{field.name} has no docstring"


ALGO_VARIANTS = [  # one switch off its default at a time (a mapping that drops or swaps a field shows)
    {"objective": "rec"}, {"eps_low": 0.1}, {"eps_high": 0.3}, {"dual_clip": 3.0}, {"rec_weight": "is"},
    {"rec_clip": "ring"}, {"objective": "opmd", "tau": 0.5}, {"kl_estimator": "k2"}, {"kl_beta": 0.01},
    {"tis_cap": 2.0}, {"tis_level": "sequence"}, {"aggregation": "token_sum_norm"}, {"advantage_form": "std_eps"},
    {"std_normalize": False}, {"leave_one_out": True}, {"gpg_scale": True}, {"red_drop": True},
    {"mask_zero_variance": False}, {"seq_eps_low": 0.01}, {"seq_eps_high": 0.02}, {"eps_low": -1.0},
    {"objective": "nope"}, {"advantage_form": "nope"},
]


def _outcome(build):
    try:
        return build()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"


def test_every_algo_switch_reaches_algos_params():
    # AlgoConfig.objective_params / advantage_params are the one translation (trainer and validation): a mapping that
    # drops or swaps a field shows as a variant whose params equal the default's, or an unrefused invalid value
    from megatron_offgrpo.config import AlgoConfig

    names = {f.name for f in dataclasses.fields(AlgoConfig)}
    assert names == {key for variant in ALGO_VARIANTS for key in variant}  # every switch is varied
    default = (AlgoConfig().objective_params(96.0), AlgoConfig().advantage_params())
    for variant in ALGO_VARIANTS:
        algo = AlgoConfig(**variant)
        built = (_outcome(functools.partial(algo.objective_params, 96.0)), _outcome(algo.advantage_params))
        assert built != default, variant
        if any(v in (-1.0, "nope") for v in variant.values()):
            assert any(isinstance(b, str) for b in built), variant  # refused with a message


def test_every_choice_key_takes_its_choices_from_its_type():
    """A choice key is a ``Literal`` field: each of its values loads, anything else is refused naming the choices, and
    the reference shows them as the key's type (no side table to forget)."""
    import typing

    from megatron_offgrpo.cli.config import key_docs
    from megatron_offgrpo.config import field_types

    types = {doc.key: doc.type for doc in key_docs()}
    choice_keys = []
    for section in dataclasses.fields(Config):
        for name, hint in field_types(type(getattr(Config(), section.name))).items():
            base = typing.get_args(hint)[0] if typing.get_origin(hint) is list else hint
            if typing.get_origin(base) is not typing.Literal:
                continue
            key, values = f"{section.name}.{name}", typing.get_args(base)
            choice_keys.append(key)
            assert types[key].endswith(" | ".join(f'"{v}"' for v in values) + ("]" if base is not hint else ""))
            if base is not hint:  # a list of choices (train.loggers)
                continue
            for value in [*values, "nope"]:
                config = Config()
                setattr(getattr(config, section.name), name, value)
                try:
                    config.validate()
                    message = ""
                except ValueError as exc:  # other rules may object to a value's combination with the defaults
                    message = str(exc)
                refused = f"{key}={value!r}: expected one of {list(values)}" in message
                assert refused == (value == "nope"), (key, value, message)
    assert len(choice_keys) >= 17 and "rollout.mode" in choice_keys and "train.loggers" in choice_keys
