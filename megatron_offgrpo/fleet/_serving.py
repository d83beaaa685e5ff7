"""What one vLLM engine serves with (the door's ``serving``): its settings, rendered for a fleet server and for the
in-process engine (``VllmSettings``), the KV cache it asks for (``kv_cache_bytes``), a fleet server's size
derived from its model (``size_server``; ``cpu_prefill_limits``: every prompt scheduled whole on vLLM CPU) and the
runner it serves the model with (``Runner``, ``runner_of``: a sequence classifier gets vLLM's pooling runner).

One name on the door for the set the in-process engine and the sizing tests read; each lives in its own module.
"""

from megatron_offgrpo.fleet._kv_cache import kv_cache_bytes
from megatron_offgrpo.fleet._runner import Runner, runner_of
from megatron_offgrpo.fleet._server_size import cpu_prefill_limits, size_server
from megatron_offgrpo.fleet._vllm_settings import VllmSettings

__all__ = ["Runner", "VllmSettings", "cpu_prefill_limits", "kv_cache_bytes", "runner_of", "size_server"]
