"""The one typed config tree: a dataclass per room, YAML recipes, ``key=value`` overrides, validation.

Only ``train/`` and ``cli/`` hold the root ``Config``; builders turn its sections into flat arguments for the
components. ``Config.validate()`` derives nothing in place and reports every error at once, naming the keys.

Inside: ``_choices`` (the values of every choice key, as ``Literal`` types), ``_tree`` (the sections and the root,
each field with its type and a docstring: docs/config.md is generated from them), ``_sections`` (the sections of
what comes beside the trainer: environments, distillation, the warm-up), ``_load`` (YAML and ``key=value``
coercion by each field's type), ``_rules`` (the cross-field rules of ``validate``).
"""

from megatron_offgrpo.config._choices import Logger
from megatron_offgrpo.config._load import ConfigError, field_types, long_component, parse_override, type_name
from megatron_offgrpo.config._tree import (AlgoConfig, Config, DataConfig, ModelConfig, OptimConfig, ParallelConfig,
                                           RolloutConfig, TrainConfig, load_config)

__all__ = ["AlgoConfig", "Config", "ConfigError", "DataConfig", "Logger", "ModelConfig", "OptimConfig",
           "ParallelConfig", "RolloutConfig", "TrainConfig", "field_types", "load_config", "long_component",
           "parse_override", "type_name"]
