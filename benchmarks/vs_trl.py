"""Benchmark: ``offgrpo train`` against TRL's GRPOTrainer 1.16, end to end, one after the other on this machine.

The same random-init tiny Qwen2 (megatron_offgrpo/assets/tiny-qwen2: hidden 128, 2 layers, the real 151,936-token
vocabulary), saved once as a HF directory both load; the same arithmetic prompts (plain format), B prompts x G
samples x T new tokens per step at temperature 1, v=1 (on-policy), no KL term, fp32, and a reward that gives every
group variance (``benchmarks._trl_side.length_parity``: the completion's character count is even). offgrpo runs its
documented command (``offgrpo train``, one process, the default engine: in-process vLLM when installed), TRL its
GRPOTrainer (transformers generation) in a process of its own. Each side's steps are timed by itself (offgrpo:
metrics.jsonl; TRL: a callback and its generation call); the first step (compilation, caches) is left out of the
medians. Peak memory is the largest sum of PSS (proportional set size: shared pages split between the processes
that map them) over each side's process tree, sampled every 0.25 s. Floors: the output layer's GEMMs of the same
shapes timed with torch.matmul at the same thread count: training's three (logits, grad of the hidden states, grad
of the weight) over the step's B x G x T response tokens, generation's one per decode step over B x G rows, T steps.

Install TRL beside the CPU torch (no CUDA build can come in under the torch constraints):
    pip install --constraint .venv/torch-constraints.txt -e ".[bench-trl]"

``--vllm-sampler`` also runs offgrpo with vLLM's own CPU sampler (``OFFGRPO_CPU_SAMPLER=vllm``), for the gain of
``fleet._cpu_sampler``'s inverse-CDF draw. ``--bf16-engine`` also runs offgrpo generating in bfloat16 under its fp32
trainer (``rollout.dtype=bfloat16``, truncated IS at 2 against the rounding), and reports the trainer / engine
log-prob gap of both offgrpo runs. offgrpo's processes keep freed large buffers in malloc's heap and back them with
huge pages (``runtime.tune_cpu_memory``); ``--trl-tuned`` also runs TRL with the same settings, to tell that gain
from the rest. The floors are timed with those settings too (their outputs fault no fresh pages).

Usage: python benchmarks/vs_trl.py [--steps 4] [--prompts 8] [--group 8] [--tokens 64] [--threads 2]
[--vllm-sampler] [--bf16-engine] [--trl-tuned]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "megatron_offgrpo" / "assets"
DATA = ["data.name=arithmetic", "data.prompt_format=plain", "data.instruction="]


def save_model(model_dir: Path, seed: int) -> None:
    """The random-init tiny Qwen2 with the Qwen2 tokenizer, as a HF directory."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ASSETS / "tiny-qwen2"), dtype=torch.float32)
    model.save_pretrained(model_dir)
    for f in (ASSETS / "qwen2-tokenizer").iterdir():
        if f.suffix in (".json", ".txt"):
            shutil.copy(f, model_dir / f.name)


def prompt_texts(model_dir: Path, count: int) -> list[str]:
    """The first ``count`` training prompts of offgrpo's arithmetic data, as text (TRL tokenizes them itself)."""
    from megatron_offgrpo.config import load_config
    from megatron_offgrpo.model import load_tokenizer
    from megatron_offgrpo.sampler import load_prompts

    config = load_config(None, [f"model.hf_path={model_dir}", *DATA])
    tokenizer = load_tokenizer(str(model_dir))
    return [tokenizer.decode(p.prompt_ids) for p in load_prompts(config, tokenizer, "train")[:count]]


def tree_pss_mb(root: int) -> float:
    """PSS of ``root`` and its descendants, MB (processes that end meanwhile count 0)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def run_measured(cmd: list[str], env: dict[str, str], log: Path) -> tuple[float, float]:
    """Run ``cmd``; returns (wall seconds, peak tree PSS MB). Exits with the log's tail if it fails."""
    peak, start = 0.0, time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(0.25):
                peak = max(peak, tree_pss_mb(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = proc.wait()
        done.set()
        sampler.join()
    wall = time.perf_counter() - start
    if code != 0:
        sys.exit(f"{cmd[2:4]} failed (exit {code}):\n" + "\n".join(log.read_text().splitlines()[-30:]))
    return wall, peak


def run_ours(args, model_dir: Path, work: Path, env: dict[str, str], name: str = "offgrpo",
             extra: tuple[str, ...] = ()) -> dict:
    out = work / name
    cmd = [sys.executable, "-m", "megatron_offgrpo.cli", "train", f"model.hf_path={model_dir}", "model.init=hf",
           *DATA, "data.reward=benchmarks._trl_side:length_parity", f"rollout.prompts_per_step={args.prompts}",
           f"rollout.group_size={args.group}", f"rollout.max_new_tokens={args.tokens}", "rollout.refresh_every=1",
           "rollout.temperature=1.0", f"optim.lr={args.lr}", f"train.steps={args.steps}", f"train.out_dir={out}",
           "train.save_every=0", "train.eval_every=0", "train.loggers=[]", *args.ours, *extra]
    wall, peak = run_measured(cmd, env, work / f"{name}.log")
    from megatron_offgrpo.runlog import read_metrics

    records = read_metrics(out)
    walls = [r["wall_s"] for r in records]
    steps = [{"step_s": b - a, "generate_s": r["time_generate_s"], "sync_s": r["time_sync_s"],
              "completion_tokens": r["response_len"] * args.prompts * args.group,
              "log_ratio_abs_mean": r.get("log_ratio_abs_mean")}
             for a, b, r in zip([0.0] + walls, walls, records)]
    return {"steps": steps, "wall_s": wall, "peak_pss_mb": peak}


def run_trl(args, model_dir: Path, work: Path, env: dict[str, str], name: str = "trl") -> dict:
    prompts = work / "prompts.json"
    prompts.write_text(json.dumps(prompt_texts(model_dir, args.prompts * args.steps)))
    result = work / f"{name}.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "_trl_side.py"), str(model_dir), str(prompts), str(result),
           f"--steps={args.steps}", f"--prompts={args.prompts}", f"--group={args.group}", f"--tokens={args.tokens}",
           f"--lr={args.lr}"]
    wall, peak = run_measured(cmd, env, work / f"{name}.log")
    return json.loads(result.read_text()) | {"wall_s": wall, "peak_pss_mb": peak}


def floors(args) -> tuple[float, float]:
    """(training's three output-layer GEMMs per step, generation's output-layer GEMMs per step), seconds."""
    import torch

    from megatron_offgrpo.runtime import tune_cpu_memory

    tune_cpu_memory()  # the GEMMs' outputs reuse their pages, as in offgrpo's processes: no page faults timed
    torch.set_num_threads(args.threads)
    hidden, vocab = 128, 151936
    n = args.prompts * args.group
    h, w = torch.randn(n * args.tokens, hidden), torch.randn(vocab, hidden)
    g, row = torch.randn(n * args.tokens, vocab), torch.randn(n, hidden)

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    train = timed(lambda: (h @ w.T, g @ w, g.T @ h))
    decode = timed(lambda: [row @ w.T for _ in range(args.tokens)])
    return train, decode


def side_line(name: str, side: dict) -> tuple[str, float, float]:
    steps = side["steps"][1:] or side["steps"]
    step = statistics.median(s["step_s"] for s in steps)
    generate = statistics.median(s["generate_s"] for s in steps)
    tokens_per_s = statistics.median(s["completion_tokens"] / s["step_s"] for s in steps)
    line = (f"{name:8} {step:8.2f} {generate:8.2f} {step - generate:8.2f} {tokens_per_s:10.1f} "
            f"{side['wall_s']:8.1f} {side['peak_pss_mb'] / 1024:8.2f}")
    return line, step, tokens_per_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per side (the first is left out)")
    parser.add_argument("--prompts", type=int, default=8, help="B: prompts per step")
    parser.add_argument("--group", type=int, default=8, help="G: samples per prompt")
    parser.add_argument("--tokens", type=int, default=64, help="T: new tokens per sample")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--threads", type=int, default=2, help="OMP threads of each side (and of the floors)")
    parser.add_argument("--seed", type=int, default=0, help="the model's random init")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "vs_trl", help="where the JSON result goes")
    parser.add_argument("--ours", nargs="*", default=[], help="extra offgrpo overrides (key=value)")
    parser.add_argument("--vllm-sampler", action="store_true", help="also run offgrpo with vLLM's own CPU sampler "
                        "(OFFGRPO_CPU_SAMPLER=vllm) instead of fleet._cpu_sampler's")
    parser.add_argument("--bf16-engine", action="store_true", help="also run offgrpo generating in bfloat16 under "
                        "its fp32 trainer (rollout.dtype=bfloat16, algo.tis_cap=2)")
    parser.add_argument("--trl-tuned", action="store_true", help="also run TRL with the CPU memory settings offgrpo "
                        "gives itself (runtime.tune_cpu_memory: huge pages, freed buffers kept by malloc)")
    args = parser.parse_args(argv)
    try:
        import trl
    except ImportError:
        sys.exit('vs_trl: TRL is not installed: pip install --constraint .venv/torch-constraints.txt -e ".[bench-trl]"')
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               TOKENIZERS_PARALLELISM="false")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        work, model_dir = Path(tmp), Path(tmp) / "model"
        save_model(model_dir, args.seed)
        print(f"B={args.prompts} x G={args.group} x T={args.tokens} tokens, {args.steps} steps per side, "
              f"{args.threads} threads, TRL {trl.__version__}", flush=True)
        result = {"ours": run_ours(args, model_dir, work, env)}
        print("offgrpo done", flush=True)
        if args.vllm_sampler:
            result["ours_vllm_sampler"] = run_ours(args, model_dir, work, env | {"OFFGRPO_CPU_SAMPLER": "vllm"},
                                                   "offgrpo_vllm_sampler")
            print("offgrpo with vLLM's sampler done", flush=True)
        if args.bf16_engine:
            result["ours_bf16_engine"] = run_ours(args, model_dir, work, env, "offgrpo_bf16_engine",
                                                  ("rollout.dtype=bfloat16", "algo.tis_cap=2.0"))
            print("offgrpo with a bf16 engine done", flush=True)
        result["trl"] = run_trl(args, model_dir, work, env)
        print("TRL done", flush=True)
        if args.trl_tuned:
            from megatron_offgrpo.runtime import tune_cpu_memory

            tuned = dict(env)
            tune_cpu_memory(tuned)
            result["trl_tuned"] = run_trl(args, model_dir, work, tuned, "trl_tuned")
            print("TRL with offgrpo's memory settings done", flush=True)
    train_floor, decode_floor = floors(args)
    print(f"\n{'':8} {'step s':>8} {'gen s':>8} {'rest s':>8} {'compl tok/s':>10} {'wall s':>8} {'peak GB':>8}")
    line, step_ours, tps_ours = side_line("offgrpo", result["ours"])
    print(line)
    if "ours_vllm_sampler" in result:
        print(side_line("vLLM smp", result["ours_vllm_sampler"])[0])
    if "ours_bf16_engine" in result:
        print(side_line("bf16 gen", result["ours_bf16_engine"])[0])
    line, step_trl, tps_trl = side_line("TRL", result["trl"])
    print(line)
    if "trl_tuned" in result:
        print(side_line("TRL tuned", result["trl_tuned"])[0])
    mem = result["ours"]["peak_pss_mb"] / result["trl"]["peak_pss_mb"]
    wall = result["trl"]["wall_s"] / result["ours"]["wall_s"]
    print(f"\noffgrpo / TRL: completion tokens/s {tps_ours / tps_trl:.2f}x (goal >= 5x), step time "
          f"{step_trl / step_ours:.2f}x faster, whole process {wall:.2f}x faster, peak memory {mem:.2f}x "
          f"(goal <= 0.5x)")
    gen = [statistics.median(s["generate_s"] for s in result[k]["steps"][1:]) for k in ("ours", "trl")]
    if "ours_vllm_sampler" in result:
        other = statistics.median(s["generate_s"] for s in result["ours_vllm_sampler"]["steps"][1:])
        print(f"generation with fleet._cpu_sampler: {other / gen[0]:.2f}x faster than with vLLM's CPU sampler "
              f"({gen[0] / args.tokens * 1000:.0f} vs {other / args.tokens * 1000:.0f} ms per decode step)")
    if "ours_bf16_engine" in result:
        bf16 = result["ours_bf16_engine"]["steps"][1:]
        gap = {k: statistics.median(s["log_ratio_abs_mean"] for s in result[k]["steps"][1:])
               for k in ("ours", "ours_bf16_engine")}
        print(f"bf16 generation: completion tokens/s {side_line('', result['ours_bf16_engine'])[2] / tps_trl:.2f}x "
              f"TRL's, generation {gen[0] / statistics.median(s['generate_s'] for s in bf16):.2f}x faster than fp32; "
              f"trainer / engine log-prob gap {gap['ours_bf16_engine']:.1e} vs {gap['ours']:.1e} nats per token")
    if "trl_tuned" in result:
        tps_tuned = side_line("", result["trl_tuned"])[2]
        print(f"TRL with offgrpo's memory settings: offgrpo / TRL {tps_ours / tps_tuned:.2f}x the completion tokens/s")
    print(f"floors: training's output-layer GEMMs {train_floor:.2f} s, generation's {decode_floor:.2f} s; "
          f"offgrpo at {(step_ours - gen[0]) / train_floor:.2f}x / {gen[0] / decode_floor:.2f}x of them, "
          f"TRL at {(step_trl - gen[1]) / train_floor:.2f}x / {gen[1] / decode_floor:.2f}x")
    result |= {"args": {k: v for k, v in vars(args).items() if k != "out"}, "floors_s": {
        "train_gemms": train_floor, "decode_gemms": decode_floor}}
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
