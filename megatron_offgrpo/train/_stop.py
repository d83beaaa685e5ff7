"""Stopping a run between steps: SIGTERM (Slurm or Kubernetes preemption, ``docker stop``) and SIGINT (Ctrl-C) ask
for a stop; the loop checkpoints at the next step boundary and the command exits 143 / 130 with one line.

A signal only sets a flag: the step in flight (a generation, a collective) finishes, because a stop in the middle of a
collective would leave the other ranks waiting. At each step boundary every rank all-reduces its flag (max over
ranks, once per step: a few bytes), so all ranks stop after the same step even when the signal reached them at
different moments (torchrun forwards its SIGTERM / SIGINT to every worker; Slurm signals every task), and the
collective checkpoint is consistent. A second Ctrl-C does not wait: it ends the process at once (the checkpoint being
written is left as ``step_X.tmp``, which never looks complete and the resume sweeps).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading

import torch
import torch.distributed as dist

EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}  # 128 + the signal's number, as a shell reports it


@dataclasses.dataclass
class RunStopped(Exception):
    """The run stopped at a step boundary on a signal, its state saved.

    Attributes:
        signum: the signal (the highest any rank received). step: the steps done. checkpoint: the checkpoint a
            ``--resume`` continues from (None: nothing trained yet, or a command without checkpoints).
    """

    signum: int
    step: int
    checkpoint: str | None
    without_checkpoint: str = "nothing trained yet, no checkpoint written"  # what the line says when there is none

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(signal.Signals(self.signum), 128 + self.signum)

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        if self.checkpoint is None:
            return f"stopped by {name} at step {self.step}: {self.without_checkpoint}"
        return f"stopped by {name} at step {self.step}: checkpoint written to {self.checkpoint}; resume with --resume"


class StopRequest:
    """SIGTERM / SIGINT handlers for the length of a run (a context manager; the previous handlers come back after).

    Outside the main thread (a library caller's worker thread) no handler can be installed: the run then never
    stops early, as before.
    """

    def __init__(self) -> None:
        self.signum = 0
        self.step = 0  # the step in flight, for the second Ctrl-C's line
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in EXIT_CODES}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signum and signum == signal.SIGINT:  # Ctrl-C twice: the user does not want to wait
            os.write(2, f"error: stopped at once by a second SIGINT during step {self.step}: no checkpoint of it; "
                        "--resume continues from the last complete one\n".encode())
            os._exit(EXIT_CODES[signal.SIGINT])  # no unwinding: threads and collectives in flight would hang it
        if not self.signum and signum == signal.SIGINT and int(os.environ.get("RANK", "0")) == 0:
            # someone at a terminal: say that it was heard (a step can take minutes) and how not to wait.
            # os.write: a handler may run inside a print to stderr, whose buffer refuses a re-entrant write
            os.write(2, f"SIGINT: stopping after step {self.step} with a checkpoint (Ctrl-C again to stop at once)\n"
                     .encode())
        self.signum = self.signum or signum

    def agreed(self, device: torch.device | str) -> int:
        """The signal any rank received (the highest number; 0: none). Collective over the world: every rank calls
        it at the same step boundary, on the device its collectives use (NCCL: CUDA)."""
        flag = torch.tensor([self.signum], dtype=torch.int32, device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
