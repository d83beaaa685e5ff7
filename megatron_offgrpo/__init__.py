"""megatron-offgrpo: off-policy GRPO for Qwen on megatron-core with a vLLM generation fleet.

The package's top holds only what every room may read without importing anything heavy: what code runs
(``version``, ``commit``, ``build_info``) and how an optional dependency reports its extra (``require_extra``); and the
hook that prepares megatron-core's first import for this machine (``_megatron_import``), whichever module imports it.
"""

from megatron_offgrpo import _megatron_import
from megatron_offgrpo._extras import MissingExtra, pyplot, require_extra
from megatron_offgrpo._version import build_info, checkout_root, commit, describe, version

_megatron_import.install()

__all__ = ["MissingExtra", "build_info", "checkout_root", "commit", "describe", "pyplot", "require_extra", "version"]
