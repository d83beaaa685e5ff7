"""Quiet consoles: `offgrpo train` / `offgrpo sft` show progress, our events and real warnings; megatron-core's and
vLLM's chatter goes to RUN/train.log, and --verbose brings it back to the console."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_offgrpo.runlog._logs import LOG_FILE, ConsoleFilter, vllm_logging_config
from tests.helpers import REPO
from megatron_offgrpo.runlog import read_metrics
from tests.train.conftest import TINY
from tests.train.trackers import tensorboard_scalars

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")


def record(name: str, level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


@pytest.mark.parametrize("name, level, message, shown", [
    ("megatron_offgrpo.train._checkpoint", logging.INFO, "checkpoint saved: runs/x/checkpoints/step_2", True),
    ("megatron_offgrpo.train._setup", logging.INFO, "run runs/x: qwen2, tp=1 ...", True),
    ("megatron_offgrpo.runtime._distributed", logging.INFO, "parallel layout: ...", False),  # a detail, not an event
    ("megatron_offgrpo.train._sync", logging.INFO, "refresh to version 3: 0.2 s", False),  # in the progress line
    ("megatron_offgrpo.train._sync", logging.WARNING, "training goes on with the servers ...", True),
    ("megatron.core.optimizer", logging.INFO, "Setting up optimizer with config OptimizerConfig(...)", False),
    ("megatron.core.optimizer", logging.WARNING, "a real megatron warning", True),
    ("py.warnings", logging.WARNING, ".../megatron/core/models/backends.py:21: UserWarning: Apex is not installed.",
     False),
    ("py.warnings", logging.WARNING, ".../site-packages/vllm/x.py:1: FutureWarning: reduce_op is deprecated", False),
    ("py.warnings", logging.WARNING, "/work/recipe_reward.py:3: UserWarning: the answer is empty", True),
    ("vllm.v1.worker.cpu_worker", logging.WARNING, "libtcmalloc is not found in LD_PRELOAD", False),  # vLLM's setup
    ("vllm.v1.engine.core", logging.ERROR, "EngineCore failed", True),
])
def test_console_filter(name, level, message, shown):
    assert ConsoleFilter().filter(record(name, level, message)) is shown


def test_vllm_logs_go_to_the_file_and_only_errors_to_the_quiet_console(tmp_path):
    quiet = vllm_logging_config(tmp_path / LOG_FILE, "%(message)s", verbose=False)
    assert quiet["handlers"]["console"]["level"] == "ERROR" and quiet["handlers"]["file"]["level"] == "INFO"
    assert quiet["loggers"]["vllm"] == {"handlers": ["file", "console"], "level": "INFO", "propagate": False}
    assert (vllm_logging_config(tmp_path / LOG_FILE, "%(message)s", verbose=True)["handlers"]["console"]["level"]
            == "INFO")


@pytest.mark.slow
def test_vllm_configures_its_loggers_from_our_file(tmp_path):
    """vLLM replaces every logging handler when it configures itself (for each engine, in each of its processes): its
    lines reach train.log, not the quiet console, and our own lines still reach both afterwards."""
    pytest.importorskip("vllm")
    script = textwrap.dedent(f"""
        import logging
        from megatron_offgrpo.runlog._logs import setup_logging
        setup_logging({str(tmp_path)!r})
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging
        configure_logging(LoggingConfig())  # what every vLLM engine does first: reads VLLM_LOGGING_CONFIG_PATH
        logging.getLogger("vllm.engine").info("vllm-info-line")
        logging.getLogger("vllm.engine").warning("vllm-warning-line")
        logging.getLogger("megatron.core.x").info("megatron-info-line")
        logging.getLogger("megatron_offgrpo.train._checkpoint").info("checkpoint-line")
        print("vllm propagates:", logging.getLogger("vllm").propagate)
    """)
    env = {k: v for k, v in ENV.items() if not k.startswith("VLLM_LOGGING")}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / LOG_FILE).read_text()
    for line in ("vllm-info-line", "vllm-warning-line", "megatron-info-line", "checkpoint-line"):
        assert line in log, log
    assert "vllm propagates: False" in proc.stdout  # vLLM applied our config file (its handlers, not the root's)
    assert "checkpoint-line" in proc.stderr
    assert not {"vllm-info-line", "vllm-warning-line", "megatron-info-line"} & set(proc.stderr.split()), proc.stderr
    assert (json.loads((tmp_path / ".vllm_logging.json").read_text())["handlers"]["file"]["filename"]
            == str(tmp_path / LOG_FILE))


@pytest.mark.slow
def test_train_console_is_quiet_and_the_log_file_has_everything(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_offgrpo.train", *TINY, "rollout.prompts_per_step=2", "rollout.group_size=2",
           "rollout.max_new_tokens=4", "train.steps=2", f"train.out_dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    console, log = proc.stderr, (out / LOG_FILE).read_text()
    assert "[    2/2] reward" in console and "checkpoint saved" in console and "run " + str(out) in console
    for chatter in ("megatron.core", "Apex is not installed", "parallel layout", "refresh to version 1"):
        assert chatter not in console, chatter
        assert chatter in log, chatter  # routed, not lost


@pytest.mark.slow
def test_sft_verbose_brings_the_chatter_back(tmp_path):
    """(The same run checks that the warm-up logs like a training run: metrics.jsonl, samples.jsonl, TensorBoard with
    every metric, run_info.json.)"""
    out = tmp_path / "sft"
    cmd = [sys.executable, "-m", "megatron_offgrpo.cli", "sft", "--verbose",
           "--config", str(REPO / "configs/tiny-cpu-sft.yaml"), "train.steps=1", "data.count=20",
           f"train.out_dir={out}", "train.samples_every=1"]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "megatron.core" in proc.stderr and "parallel layout" in proc.stderr and "warm-up model:" in proc.stdout
    assert "megatron.core" in (out / LOG_FILE).read_text()
    assert "[    1/1] cross-entropy " in proc.stderr
    (record,) = read_metrics(out)
    assert {"loss", "grad_norm", "lr", "tokens", "tokens_per_s", "time_step_s", "wall_s"} <= set(record)
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["response"].startswith("#### ") and "What is" in rows[0]["prompt"]
    assert json.loads((out / "run_info.json").read_text())["config"]["train"]["out_dir"] == str(out)
    if importlib.util.find_spec("tensorboard"):
        assert set(record) - {"step"} == set(tensorboard_scalars(out))
