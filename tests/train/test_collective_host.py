"""``rollout.collective_host`` reaches the collective transport the trainer builds (config -> ``make_rollout_engine``
-> ``make_engine(FleetClientSpec)`` -> ``CollectiveTransport.host``), and only dialable addresses validate; likewise
``rollout.shm_dir`` for the shm transport. No server is started: ``FleetEngine.from_state`` (which would connect to
the fleet) is replaced by one returning the transport."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from megatron_offgrpo.config import load_config
from megatron_offgrpo.rollout import FleetEngine
from megatron_offgrpo.transports import CollectiveTransport, DiskTransport, SharedMemoryTransport
from megatron_offgrpo.sampler._rollout_side import make_rollout_engine
from tests.helpers import REPO

RECIPE = REPO / "configs" / "tiny-cpu.yaml"
FLEET = ["rollout.engine=fleet", "rollout.fleet_state=runs/fleet"]


def _fleet_state(directory: Path, *hosts: str) -> Path:
    """A fleet state as `offgrpo fleet start` writes it, with one server on each host."""
    servers = [{"name": f"s{i}@{h}:8000", "url": f"http://{h}:8000", "port": 8000} for i, h in enumerate(hosts)]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "fleet.json").write_text(json.dumps({"model_dir": "m", "served_model_name": "policy",
                                                      "servers": servers}))
    return directory


@pytest.fixture
def transport_of(monkeypatch, tmp_path):
    """``(server hosts, overrides) -> the transport object the trainer's engine would refresh through``."""
    monkeypatch.setattr(FleetEngine, "from_state", classmethod(lambda cls, state, transport, **kw: transport))

    def build(*overrides: str, hosts: tuple[str, ...] = ("127.0.0.1", "127.0.0.1")):
        state = _fleet_state(tmp_path / "fleet", *hosts)
        config = load_config(RECIPE, [*FLEET, f"rollout.fleet_state={state}", *overrides])
        return make_rollout_engine(config, Path("unused-model-dir"), tmp_path, max_positions=128)

    return build


def test_collective_host_reaches_the_transport(transport_of):
    transport = transport_of("rollout.transport=collective", "rollout.collective_host=10.1.2.3", "rollout.bucket_mb=2")
    assert isinstance(transport, CollectiveTransport)
    assert transport.host == "10.1.2.3" and transport.bucket_bytes == 2 * 1024**2
    assert transport._store is None  # nothing is started before the first refresh


def test_default_is_loopback_for_a_local_fleet_and_this_node_for_a_remote_one(transport_of):
    transport = transport_of("rollout.transport=collective")
    assert isinstance(transport, CollectiveTransport) and transport.host == "127.0.0.1"
    # any loopback address is this machine (Debian names its host 127.0.1.1)
    assert transport_of("rollout.transport=collective", hosts=("localhost", "127.0.1.1")).host == "127.0.0.1"
    # servers on other nodes dial rank 0's node, which only the running trainer knows
    assert transport_of("rollout.transport=collective", hosts=("127.0.0.1", "gpu-node-7")).host == socket.getfqdn()


def test_disk_transport_ignores_it(transport_of):
    # like rollout.fleet_state for non-fleet engines: unused, so a launcher may always pass rank 0's node
    assert isinstance(transport_of("rollout.transport=disk", "rollout.collective_host=node0"), DiskTransport)


def test_shm_transport_gets_its_directory_and_needs_the_fleet(transport_of, tmp_path):
    transport = transport_of("rollout.transport=shm", f"rollout.shm_dir={tmp_path}", "rollout.bucket_mb=2")
    assert isinstance(transport, SharedMemoryTransport)
    assert transport.directory == tmp_path and transport.bucket_bytes == 2 * 1024**2
    assert transport._session is None  # nothing is written before the first refresh
    # this machine's name counts as here; a server elsewhere is refused before training starts (198.51.100.0/24 is
    # a documentation range: binding to it fails here, and nothing is sent)
    assert isinstance(transport_of("rollout.transport=shm", hosts=("localhost", socket.gethostname())),
                      SharedMemoryTransport)
    with pytest.raises(ValueError,
                       match=r"transport 'shm' needs every fleet server on this machine.*\['s1@198.51.100.7:8000'\]"):
        transport_of("rollout.transport=shm", hosts=("127.0.0.1", "198.51.100.7"))
    with pytest.raises(ValueError, match="rollout.transport='shm' needs rollout.engine='fleet'"):
        load_config(RECIPE, ["rollout.engine=vllm", "rollout.transport=shm"])


@pytest.mark.parametrize("host", ["node0.cluster", "10.0.0.7", "fe80::1"])
def test_plain_addresses_validate(host):
    config = load_config(RECIPE, [*FLEET, "rollout.transport=collective", f"rollout.collective_host={host}"])
    assert config.rollout.collective_host == host


@pytest.mark.parametrize(
    "host,message",
    [
        ("0.0.0.0", "is a bind-all address"),
        ("'::'", "is a bind-all address"),
        ("node0:29500", "give the host only ('node0')"),
        ("tcp://node0", "not a URL or path"),
        ("'node 0'", "without spaces"),
        ("''", "without spaces"),
    ],
)
def test_undialable_addresses_are_refused_naming_the_key(host, message):
    with pytest.raises(ValueError,
                       match=r"rollout\.collective_host=.*" + message.replace("(", r"\(").replace(")", r"\)")):
        load_config(RECIPE, [*FLEET, "rollout.transport=collective", f"rollout.collective_host={host}"])
