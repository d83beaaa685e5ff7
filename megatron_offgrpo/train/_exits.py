"""How ``offgrpo train`` and ``offgrpo sft`` end on the causes the project knows: one line, the right exit code, no
traceback, and the run directory's lock released whatever happens."""

from __future__ import annotations

import os
import sys
from typing import Callable, TypeVar

from megatron_offgrpo.config import ConfigError
from megatron_offgrpo.envs import EnvironmentContractError, EnvironmentTimeout
from megatron_offgrpo.rollout import errors
from megatron_offgrpo.runlog import RunLock, no_space_line
from megatron_offgrpo.runtime import SaveFailed
from megatron_offgrpo.sampler import NoLearningSignalError
from megatron_offgrpo.train._stop import RunStopped

T = TypeVar("T")


def run_to_exit(run: Callable[[], T], out_dir: str, lock: RunLock | None) -> T:
    """``run()``'s result; a known cause ends the process instead:
    - the task against the policy (no learning signal), a dead engine, a failed background save, an environment stuck
      past its bound or breaking its contract (on every rank): exit 1, one line (an environment's keeps its traceback);
    - bad input only known once read (the tokenized prompts' lengths): exit 2, one line, as preflight's;
    - SIGTERM / SIGINT, checkpointed: 143 / 130 from every rank, the line once per job (rank 0);
    - a full disk: exit 1, one line naming the path; any other ``OSError`` as it is.
    """
    try:
        return run()
    except (NoLearningSignalError, errors.EngineDiedError, EnvironmentTimeout, EnvironmentContractError,
            SaveFailed) as exc:
        sys.exit(f"error: {exc}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except RunStopped as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(exc, file=sys.stderr)
        sys.exit(exc.exit_code)
    except OSError as exc:
        if (line := no_space_line(exc, out_dir)) is None:
            raise
        sys.exit(line)
    finally:
        if lock is not None:
            lock.release()
