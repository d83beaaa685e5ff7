"""The run directory's rules, checked before any process group, model or engine exists (``offgrpo train`` and
``offgrpo sft`` alike): a usable path, one writer at a time (a lock), never a new run over an earlier one's records
unless ``train.overwrite`` moves them aside, and on a resume records that can be read. A refusal is one line on
stderr and exit 2, having written nothing; every torchrun rank reaches the same verdict."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from megatron_offgrpo.config import Config
from megatron_offgrpo.runlog._checkpoints import torn_fate
from megatron_offgrpo.runlog._metrics import SAMPLES_FILE, cut_torn_tail, numbered_records

LOCK_FILE = ".offgrpo.lock"
NAME_MAX = 255  # bytes of one path component on every filesystem a run is likely to write (ext4, xfs, NFS, Lustre)
_OWNER_WAIT_S = 2.0  # how long a non-zero rank waits for its rank 0 to write the lock's record


def _refuse(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def path_error(out_dir: str, overwrite: bool) -> str | None:
    """What makes ``out_dir`` unusable as a run directory, or None: empty, a component over 255 bytes, a file or
    under a file; with ``overwrite``, the working directory, one of its ancestors or the checkout's root (moving
    it aside would move the user's own files)."""
    key = f"train.out_dir={out_dir}"
    if not out_dir.strip():
        return "train.out_dir is empty: name the run directory, e.g. train.out_dir=runs/NAME"
    path = Path(out_dir)
    if long := next((part for part in path.parts if len(part.encode()) > NAME_MAX), None):
        return f"{key}: the component {long[:40]}... is {len(long.encode())} bytes, over the {NAME_MAX} a file " \
               "name may have: choose a shorter train.out_dir"
    try:
        for parent in (path, *path.parents):
            if parent.exists() and not parent.is_dir():
                where = "is a file" if parent == path else f"lies under the file {parent}"
                return f"{key} {where}: a run directory must be a directory; choose another train.out_dir"
    except OSError as exc:  # a path over the system's length limit (short components), a directory not searchable
        return f"{key}: {exc.strerror}: choose another train.out_dir"
    if overwrite:
        from megatron_offgrpo import checkout_root

        here, real = Path.cwd().resolve(), path.resolve()
        root = checkout_root()
        if real == here or real in here.parents or (root is not None and real in (root, *root.parents)):
            return (f"{key} with train.overwrite=true: {real} holds the working directory or the checkout, which "
                    "would be moved aside; choose a run directory of its own, e.g. train.out_dir=runs/NAME")
    return None


def earlier_run(run_dir: Path) -> str | None:
    """What shows that ``run_dir`` holds an earlier run (its metrics or checkpoints), or None."""
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        return "metrics.jsonl"
    if any((run_dir / "checkpoints").glob("step_*")):
        return "checkpoints/"
    return None


def _job_id() -> str:
    """Who a torchrun job is, the same on each of its ranks (its rendezvous address and run id); a lone process:
    its own pid."""
    if "MASTER_PORT" not in os.environ:
        return f"pid {os.getpid()}"
    return (f"{os.environ.get('MASTER_ADDR', '')}:{os.environ['MASTER_PORT']}/"
            f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}")


@dataclasses.dataclass
class RunLock:
    """An exclusive ``flock`` on ``RUN/.offgrpo.lock``, held by the writing process (rank 0) for the whole run. The
    kernel drops it when that process ends, however it ends (``kill -9`` included): a dead run never blocks the next.
    The file holds the holder's record (pid, host, job, command) for the message a refused run prints."""

    path: Path
    fd: int | None

    @classmethod
    def acquire(cls, run_dir: Path, command: str) -> RunLock:
        """Take the lock of ``run_dir`` (created if missing) or refuse (exit 2) naming the run that holds it."""
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + _OWNER_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                # a rank of this job probing (``check_lock``) holds it for microseconds: try again for a while
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                os.close(fd)
                _refuse(_locked_message(run_dir, _holder(path)))
        record = {"pid": os.getpid(), "host": socket.gethostname(), "job": _job_id(), "command": command,
                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)  # the same inode: the lock and its record stay one file
        lock = cls(path, fd)
        # A forked child (an engine, a data worker) would inherit the descriptor and keep the run "locked" after the
        # trainer died: its copy is closed at once (closing a copy never releases the parent's lock).
        os.register_at_fork(after_in_child=lock._close_in_child)
        return lock

    def _close_in_child(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def release(self) -> None:
        """Drop the lock (the file stays: removing it would let two runs lock two different files)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _holder(path: Path) -> dict:
    """The record of the lock's holder; {} while it is being written or unreadable."""
    try:
        record = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _locked_message(run_dir: Path, holder: dict) -> str:
    who = (f"pid {holder.get('pid')} on {holder.get('host')}, offgrpo {holder.get('command')} since "
           f"{holder.get('since')}") if holder else "another process"
    return (f"train.out_dir={run_dir} is locked by a run in progress ({who}): wait for it to end, stop it, or "
            "choose another train.out_dir")


def check_lock(run_dir: Path) -> None:
    """A torchrun rank other than 0: refuse (exit 2) when another job holds the lock of ``run_dir``, as its rank 0
    will; this job's own rank 0 holding it is fine. Probes with a shared lock released at once."""
    path = run_dir / LOCK_FILE
    if not path.is_file():
        return
    deadline = time.monotonic() + _OWNER_WAIT_S
    while True:
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return  # free: rank 0 takes it
        except BlockingIOError:
            holder = _holder(path)
            if holder.get("job") == _job_id():
                return  # this job's rank 0
            if time.monotonic() >= deadline:  # (an empty record: rank 0 of this job may be writing it; waited)
                _refuse(_locked_message(run_dir, holder))
        finally:
            os.close(fd)
        time.sleep(0.05)


def _model_inside(config: Config, run_dir: Path) -> Path | None:
    """``model.hf_path`` when it is a local path inside ``run_dir`` (moving the run aside would move the model the
    new run starts from), else None."""
    model = Path(config.model.hf_path)
    if not model.exists():
        return None  # a hub id or a bundled asset's name
    real, run = model.resolve(), run_dir.resolve()
    return model if real == run or run in real.parents else None


def _check_records(run_dir: Path) -> None:
    """A resume continues ``metrics.jsonl`` and ``samples.jsonl``: a bad record before the last is refused, naming
    file and line (exit 2, before anything is written). The last line may be torn (``_cut_torn_tails``)."""
    for name in ("metrics.jsonl", SAMPLES_FILE):
        if (path := run_dir / name).is_file():
            try:
                numbered_records(path, warn_torn=False)
            except ValueError as exc:
                _refuse(f"{exc}: repair or remove that line, or start a new run")


def _cut_torn_tails(run_dir: Path) -> None:
    """Cut a torn last line (a kill or a full disk during its write) off the records a resume continues, saying
    so and what becomes of its step (``runlog._checkpoints.torn_fate``). Rank 0, holding the lock."""
    for name in ("metrics.jsonl", SAMPLES_FILE):
        if (path := run_dir / name).is_file() and (line := cut_torn_tail(path)) is not None:
            records = numbered_records(path, warn_torn=False)
            fate = torn_fate(name, records[-1][1].get("step") if records else None, run_dir)
            print(f"WARNING: {path}:{line}: a torn last record (the run stopped while writing it) was cut off; {fate}",
                  file=sys.stderr)


def claim_run_dir(config: Config, command: str = "train") -> RunLock | None:
    """Check ``train.out_dir`` and claim it for this run; returns the lock to hold until the run ends (global rank 0;
    None on the other ranks). Called by every rank before any process group exists: only rank 0 takes the lock,
    moves an earlier run aside or repairs records, and every rank refuses what rank 0 refuses (exit 2, one line).

    A new run (no ``train.resume``) never writes into an earlier run's directory: refused, or with
    ``train.overwrite`` the earlier run is first moved aside to ``OUT_DIR.replaced-TIMESTAMP``. ``command`` names the
    writer in the lock (``offgrpo sft`` has no resume: ``train.resume`` is refused there).
    """
    t = config.train
    if error := path_error(t.out_dir, t.overwrite and not t.resume):
        _refuse(error)
    if command == "sft" and t.resume:
        _refuse("train.resume=true: offgrpo sft has no resume (a warm-up is short: run it again, with "
                "train.overwrite=true to move this one aside)")
    run_dir, rank0 = Path(t.out_dir), int(os.environ.get("RANK", "0")) == 0
    # First the lock, where a run took one: a live run is never joined nor moved aside. A directory without a lock
    # file is locked only once it passed every check below: a refusal leaves it as it was.
    lock = RunLock.acquire(run_dir, command) if rank0 and (run_dir / LOCK_FILE).is_file() else None
    if not rank0:
        check_lock(run_dir)
    if t.resume:
        _check_records(run_dir)
    found = None if t.resume else earlier_run(run_dir)
    if found is not None and not t.overwrite:
        if lock is not None:
            lock.release()
        fix = ("offgrpo sft has no resume: choose another train.out_dir" if command == "sft"
               else "resume it with --resume, choose another train.out_dir")
        _refuse(f"train.out_dir={run_dir} holds an earlier run ({found}): {fix}, or pass train.overwrite=true to "
                "move it aside")
    if found is not None:  # train.overwrite
        if model := _model_inside(config, run_dir):
            if lock is not None:
                lock.release()
            _refuse(f"train.overwrite=true: model.hf_path={model} lies inside train.out_dir={run_dir}, which would "
                    "be moved aside with it: copy the model out first, or choose another train.out_dir")
        if rank0:  # holding the earlier run's lock while it moves
            old = lock or RunLock.acquire(run_dir, command)
            real = run_dir.resolve()  # "runs/x/.." has no name to suffix; path_error refused "/" and the cwd
            aside = real.with_name(f"{real.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
            real.rename(aside)
            print(f"train.overwrite: the earlier run in {run_dir} was moved to {aside}", file=sys.stderr)
            lock = RunLock.acquire(run_dir, command)
            old.release()
    if rank0 and lock is None:
        lock = RunLock.acquire(run_dir, command)
    if lock is not None and t.resume:
        _cut_torn_tails(run_dir)
    return lock

