"""Runtime: TE detection falls back cleanly, the CPU layer is explicit and idempotent, layouts are validated."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_offgrpo import runtime


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def _fake_broken_te(root) -> None:
    """A fake transformer_engine under ``root`` that fails like a real one without CUDA (RuntimeError, not
    ImportError)."""
    pkg = root / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('libcudart.so: cannot open shared object file')\n")
    (pkg / "pytorch" / "__init__.py").write_text("")


def test_te_status_without_cuda_says_why():
    usable, reason = runtime.te_status()
    assert not usable and reason  # this CPU machine: TE not installed or no CUDA
    assert runtime.default_backend() == ("nccl" if torch.cuda.is_available() else "gloo")


def test_broken_te_is_hidden_so_megatron_core_still_imports(tmp_path):
    _fake_broken_te(tmp_path)
    proc = run_python(f"""
        import sys; sys.path.insert(0, {str(tmp_path)!r})
        from megatron_offgrpo.runtime import hide_broken_te, te_status
        print(te_status())
        hide_broken_te()
        import megatron.core.models.gpt.gpt_layer_specs as specs
        from megatron.core.extensions import transformer_engine as te_ext
        print('HAVE_TE', te_ext.HAVE_TE)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CUDA is not available" in proc.stdout and "HAVE_TE False" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, megatron-core's import is left as it is")
def test_megatron_core_imported_after_the_package_is_prepared_for_a_cpu_machine(tmp_path):
    """Whichever module imports megatron-core first, after `import megatron_offgrpo` (every process of the project):
    a broken TE is hidden, megatron's jit_fuser stays eager (no dynamo or inductor imported for it), torch.compile is
    torch's again afterwards, and megatron.core keeps its real loader."""
    _fake_broken_te(tmp_path)
    proc = run_python(f"""
        import sys; sys.path.insert(0, {str(tmp_path)!r})
        import importlib.machinery, megatron_offgrpo
        from megatron.core import jit
        assert jit.jit_fuser(len) is len, jit.jit_fuser
        assert 'torch._inductor' not in sys.modules and 'torch._dynamo' not in sys.modules
        from megatron.core.extensions import transformer_engine as te_ext
        import megatron.core, torch
        assert te_ext.HAVE_TE is False
        assert torch.compile.__module__ == 'torch', torch.compile
        assert isinstance(megatron.core.__loader__, importlib.machinery.SourceFileLoader), megatron.core.__loader__
        print('ok')
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


def test_cpu_compat_is_explicit_and_idempotent():
    proc = run_python("""
        import torch
        import megatron.core  # importing ours or megatron's patches nothing
        from megatron_offgrpo.runtime import apply_cpu_compat
        try:
            torch.cuda.current_device(); print('patched-at-import')
        except (AssertionError, RuntimeError):
            print('untouched-at-import')
        first = apply_cpu_compat(); second = apply_cpu_compat()
        assert first == second and len(first) == 9, first
        print(torch.cuda.current_device())
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        print(type(get_cuda_rng_tracker()).__name__)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["untouched-at-import", "cpu", "CpuRNGStatesTracker"]


def test_cpu_rng_tracker_forks_named_states():
    from megatron_offgrpo.runtime._rng import CpuRNGStatesTracker

    tracker = CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before), "fork must restore the default generator"
    with tracker.fork("model-parallel-rng"):
        b = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(a, torch.rand(3)) and not torch.equal(a, b), "the named state advances across forks"
    with pytest.raises(RuntimeError, match="not added"):
        with tracker.fork("missing"):
            pass


def test_layout_not_dividing_world_size_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"tp=4 x pp=1 does not divide world_size=2"):
        runtime.init_parallel(tp=4, pp=1)


def test_one_process_group_leaves_no_rendezvous_in_the_environment():
    """A one-process group must not export MASTER_ADDR/MASTER_PORT: every child process inherited the port and its own
    one-process group then failed with EADDRINUSE (the whole suite's subprocess runs, once a test had initialised
    in-process)."""
    proc = run_python("""
        import os
        for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
            os.environ.pop(key, None)
        from megatron_offgrpo.runtime import destroy_parallel, init_parallel
        ctx = init_parallel(1, 1)
        print(ctx.world_size, os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
        destroy_parallel()
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-3:] == ["1", "None", "None"]


def test_a_checkpoint_save_hands_its_results_back_in_process():
    """megatron's first save spawns a results server that imports torch (3 s); with the in-process queue the save
    and its load are the same and no process is left behind (megatron's server would be a live child)."""
    proc = run_python("""
        import multiprocessing, tempfile
        import torch
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import ShardedTensor
        from megatron_offgrpo.runtime import init_parallel, use_in_process_save_queue

        init_parallel(1, 1)
        assert use_in_process_save_queue() and use_in_process_save_queue()  # idempotent
        weight = torch.arange(12.0).reshape(3, 4)
        for _ in range(2):  # the queue is megatron's per process: the second save reuses it
            with tempfile.TemporaryDirectory() as out:
                dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weight)}, out)
                empty = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))}
                assert torch.equal(dist_checkpointing.load(empty, out)["w"], weight)
        print("CHILDREN", multiprocessing.active_children())
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CHILDREN []" in proc.stdout, proc.stdout
