"""``torchrun --nproc_per_node N -m megatron_offgrpo.train --config RECIPE [key=value ...]``: an alias of
``offgrpo train`` (``megatron_offgrpo.cli.train``), run as that module's ``__main__`` rather than imported, so the
trainer's room never depends on the commands that use it."""

import runpy

runpy.run_module("megatron_offgrpo.cli.train", run_name="__main__", alter_sys=True)
