"""Benchmark: what a short CPU run pays before and around its first step, in one table (issue 35).

Each row runs ``--repeats`` times in fresh interpreters (``OMP_NUM_THREADS=1``), and the median is reported:
- ``import trainer`` with and without the package's megatron-core import hook (``megatron_offgrpo._megatron_import``:
  on a machine without CUDA, ``torch.compile`` stays an identity while megatron-core decorates its fusions);
- one CPU draw of a token from each of 8 rows of Qwen's 151,936-entry vocabulary, by ``torch.multinomial`` (what
  the transformers engine's ``generate`` used: one exponential per vocabulary entry) and by the fleet's exact
  inverse-CDF sampler (``fleet.cpu_sampler.sample_from_logprobs``, what it uses now), per decode step;
- ``offgrpo sft`` and ``offgrpo train`` (one step of the tiny recipes on the bundled model, random weights, no
  evaluation or checkpoint), with the transformers engine and with the in-process vLLM engine, and under torchrun at
  TP2 (the README's tensor-parallel command: two ranks, rank 0's vLLM engine core in a process of its own): the wall
  time, and the seconds until the first step's progress line (start-up: imports, checks, model, engine);
- a 6-step in-process vLLM run with glibc's one malloc arena (``runtime.tune_cpu_memory``'s default) and with 8
  (``MALLOC_ARENA_MAX=8``, a user's own value winning): the engine's loop thread maps its decode buffers afresh at
  every step in an arena of its own.

Usage: python benchmarks/startup.py [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._tables import markdown  # noqa: E402

TINY = REPO / "megatron_offgrpo" / "assets" / "tiny-qwen2"
IMPORT = "import megatron_offgrpo.train.loop"
NO_HOOK = ("import sys, megatron_offgrpo; from megatron_offgrpo import _megatron_import as m; "
           "sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, m._MegatronCoreFinder)]; ")
DRAWS = """
import time, torch
from megatron_offgrpo.fleet import cpu_sampler
torch.manual_seed(0)
logprobs = torch.log_softmax(torch.randn(8, 151936), dim=-1)
def median(fn):
    fn(); times = []
    for _ in range(20):
        start = time.perf_counter(); fn(); times.append(time.perf_counter() - start)
    return sorted(times)[10]
draw = cpu_sampler.sample_from_logprobs
print(median(lambda: torch.multinomial(logprobs.exp(), 1)), median(lambda: draw(logprobs, {})))
"""
QUIET_RUN = ["model.init=random", f"model.hf_path={TINY}", "train.steps=1", "train.eval_every=0",
             "train.save_every=0", "train.loggers=[]", "train.overwrite=true"]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")


def _seconds(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=_env(), check=True, capture_output=True, timeout=600)
    return time.perf_counter() - start


def _run(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """(seconds to the first step's progress line, wall seconds) of one command (``env``: variables added)."""
    start, first, tail = time.perf_counter(), None, []
    with subprocess.Popen(argv, env=_env() | (env or {}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        for line in proc.stdout:
            tail = (tail + [line])[-20:]
            if first is None and line.startswith("[    1/"):
                first = time.perf_counter() - start
        code = proc.wait(timeout=600)
    if code != 0 or first is None:
        raise RuntimeError(f"{' '.join(argv)}: exit {code}, first step line {'seen' if first else 'never seen'}:\n"
                           + "".join(tail))
    return first, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per row (the median is reported)")
    parser.add_argument("--out", type=Path, default=Path("runs/startup"), help="the table and numbers go here")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")
    offgrpo = [sys.executable, "-m", "megatron_offgrpo.cli"]
    rows = []

    def row(name: str, samples: list[float], first: list[float] | None = None, note: str = "") -> None:
        rows.append({"what": name, "median s": f"{statistics.median(samples):.3g}",
                     "to step 1 line s": f"{statistics.median(first):.1f}" if first else "",
                     "runs": len(samples), "note": note})
        print(f"startup: {name}: {rows[-1]['median s']} s", flush=True)

    row("import trainer, hook on", [_seconds(IMPORT) for _ in range(args.repeats)])
    row("import trainer, hook off", [_seconds(NO_HOOK + IMPORT) for _ in range(args.repeats)],
        note="megatron-core's fusions compiled by torch.compile at import")
    out = subprocess.run([sys.executable, "-c", DRAWS], env=_env(), check=True, capture_output=True, text=True)
    multinomial, inverse_cdf = map(float, out.stdout.split())
    row("draw 8 tokens of 151,936, torch.multinomial", [multinomial], note="median of 20 draws")
    row("draw 8 tokens of 151,936, fleet inverse CDF", [inverse_cdf], note="median of 20 draws")
    with tempfile.TemporaryDirectory() as tmp:
        commands = {
            "offgrpo sft, 1 step": [*offgrpo, "sft", "--config", "configs/tiny-cpu-sft.yaml", *QUIET_RUN,
                                    f"train.out_dir={tmp}/sft"],
            "offgrpo train, 1 step, transformers engine": [
                *offgrpo, "train", "--config", "configs/tiny-cpu.yaml", *QUIET_RUN, "rollout.engine=transformers",
                f"train.out_dir={tmp}/hf"],
            "offgrpo train, 1 step, in-process vLLM": [
                *offgrpo, "train", "--config", "configs/tiny-cpu.yaml", *QUIET_RUN, "rollout.engine=vllm",
                f"train.out_dir={tmp}/vllm"],
            "torchrun TP2 train, 1 step, in-process vLLM": [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "megatron_offgrpo.cli",
                "train", "--config", "configs/tiny-cpu.yaml", *QUIET_RUN, "parallel.tp=2", "rollout.engine=vllm",
                f"train.out_dir={tmp}/tp2"],
        }
        for name, argv in commands.items():
            timed = [_run(argv) for _ in range(args.repeats)]
            row(name, [wall for _, wall in timed], [first for first, _ in timed])
        six_steps = [*offgrpo, "train", "--config", "configs/tiny-cpu.yaml", *QUIET_RUN, "train.steps=6",
                     "rollout.engine=vllm", f"train.out_dir={tmp}/arenas"]
        arenas = {"one malloc arena (default)": {}, "MALLOC_ARENA_MAX=8": {"MALLOC_ARENA_MAX": "8"}}
        timed = {name: [] for name in arenas}
        for _ in range(args.repeats):  # interleaved, so the machine's drift falls on both alike
            for name, env in arenas.items():
                timed[name].append(_run(six_steps, env))
        for name, runs in timed.items():
            row(f"offgrpo train, 6 steps, in-process vLLM, {name}", [wall for _, wall in runs],
                [first for first, _ in runs], note="v = 4: one refresh")
    columns = ["what", "median s", "to step 1 line s", "runs", "note"]
    table = markdown(columns, rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup.md").write_text(table + "\n")
    (args.out / "startup.json").write_text(json.dumps(rows, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
