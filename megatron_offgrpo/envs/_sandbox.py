"""Run model-written Python contained: the code is hostile by assumption, the caller and the machine stay untouched.

``run_python(code)`` starts a fresh interpreter (``python -I -S -B``: no site-packages, no environment variable of
ours, no inherited descriptor) in its own session, in a fresh scratch directory that is its cwd and is removed
afterwards. The child (``_sandbox_boot.py``) walls itself in, strongest layer first:

- **kernel, namespaces** (where unprivileged user namespaces work; they did on the machine this was written on, as
  root; many containers forbid them): a network namespace, so no network at all; a mount namespace whose root holds
  only the standard library and the system libraries (read-only; the stdlib's site-packages hidden) and the scratch
  directory, so no other file exists for the code. The mounts are then locked by a second, nested user namespace.
- **kernel, rlimits**: CPU seconds, address space, file size, no core file, 64 descriptors, no process (RLIMIT_NPROC;
  the kernel exempts uid 0 from it, so as root this one is void).
- **kernel, seccomp** (x86_64 and aarch64): no fork/exec/clone of a process, no socket, no signal to another
  process, no mount/unshare/setns/pivot_root (the namespaces cannot be undone), no setrlimit (the limits cannot be
  raised, which root could), no ptrace, io_uring, bpf, perf, keyring or module calls.
- **Python, an audit hook** (``sys.addaudithook``), always on: refuses network, process creation, signals, threads
  (3.11 has no audit event for them: ``_thread.start_new_thread`` is replaced), ctypes and extension modules from
  outside the standard library, tracing, code-object surgery and gc introspection, and file access outside the
  scratch directory (reads are also allowed in the standard library: not its site-packages, not our venv, not /work,
  not $HOME; regular files only, no symlink, no chdir). It gives the model its one-line reasons.
  It is NOT a security boundary (PEP 578 says so): it runs inside the interpreter the code controls. It is hardened
  against the easy tricks (it looks up no global name and holds no mutable table, so rebinding ``os.path`` or a
  builtin does not reach it; with no symlink and no chdir, what it checked is what gets opened), but a CPython
  memory bug, or native code reached without an audit event (``marshal.loads`` of crafted bytecode through
  importlib; ``os.stat`` of any path raises no event, so the existence and size of files leak) is beyond it. Where
  the namespaces or seccomp are missing (logged once, as a warning), it is all that guards files and processes.
  It alone bounds the number of files written (256, each at most ``file_bytes``): the scratch dir is on /tmp's disk.

The parent, whatever the child does: keeps at most ``output_bytes`` of its output (and kills the run when it writes
more), kills its whole process group and every process of its session when it exits or at the wall-clock limit,
and reaps it. Linux only (pidfd, /proc).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_offgrpo.envs import _sandbox_boot as boot

logger = logging.getLogger(__name__)

_BOOT = Path(boot.__file__).resolve()


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """What one run may use.

    Attributes:
        cpu_seconds: CPU time (RLIMIT_CPU, rounded up to whole seconds).
        wall_seconds: wall-clock time; then the run's whole process group and session are killed.
        memory_bytes: address space (RLIMIT_AS); the interpreter itself takes about 15 MiB of it.
        output_bytes: stdout + stderr kept; a run that writes more is killed.
        file_bytes: the largest file the code may write in its scratch directory (RLIMIT_FSIZE).
    """

    cpu_seconds: float = 5.0
    wall_seconds: float = 10.0
    memory_bytes: int = 512 * 2**20
    output_bytes: int = 4096
    file_bytes: int = 1 * 2**20

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "wall_seconds", "memory_bytes", "output_bytes", "file_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name}={getattr(self, name)!r}: must be > 0")
        if self.memory_bytes < 64 * 2**20:
            raise ValueError(f"SandboxLimits.memory_bytes={self.memory_bytes}: the interpreter needs >= 64 MiB")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What one run gave.

    Attributes:
        output: stdout then stderr as the model should see them, cut to ``output_bytes`` (a marker line says so).
        error: None when the code ran and exited 0; else one short line ("timed out after 10 s (wall clock)",
            "memory limit (512 MiB) exceeded", "exit status 1", "network access is not allowed", ...).
        truncated: True when output was dropped.
        seconds: wall-clock time of the call.
    """

    output: str
    error: str | None
    truncated: bool
    seconds: float

    def for_model(self) -> str:
        """The text a tool response gives the model: the output, then an ``error: ...`` line if the run failed."""
        text = self.output
        if self.error is not None:
            text += ("" if not text or text.endswith("\n") else "\n") + f"error: {self.error}"
        return text or "(no output)"


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:  # noqa: B008 (frozen)
    """Run ``code`` (a Python module's source) contained; never raises for anything the code does.

    Safe to call from several threads at once: each call has its own process and scratch directory.

    Args:
        code: the source, run as ``__main__`` (``main.py`` in tracebacks) with the scratch directory as cwd.
        limits: what the run may use.

    Returns:
        The output, the error line (None on success), whether output was dropped, and the time taken.
    """
    missing = [layer for layer in boot.LAYERS if layer not in _active_layers()]
    if missing:
        _warn_once(tuple(missing))
    return _run(code, limits, boot.LAYERS)


@functools.cache
def _active_layers() -> tuple[str, ...]:
    """The layers that work on this machine (one probe run, once per process)."""
    base = _make_base("")
    try:
        proc = subprocess.run(_argv(base, SandboxLimits(), (*boot.LAYERS, "probe")), capture_output=True,
                              stdin=subprocess.DEVNULL, env=_env(base), start_new_session=True, timeout=30)
        return tuple(proc.stdout.decode().strip().split(","))
    finally:
        shutil.rmtree(base, ignore_errors=True)


@functools.cache
def _warn_once(missing: tuple[str, ...]) -> None:
    logger.warning("sandbox: %s unavailable on this machine, weaker containment: what they guard falls to the other "
                   "layers (the audit hook is not a security boundary; see megatron_offgrpo/envs/_sandbox.py)",
                   ", ".join(missing))


def _run(code: str, limits: SandboxLimits, layers: tuple[str, ...]) -> SandboxResult:
    """``run_python`` with the child's layers chosen (tests switch some off to check the others alone)."""
    start = time.monotonic()
    base = _make_base(code)
    try:
        proc = subprocess.Popen(_argv(base, limits, layers), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=_env(base), close_fds=True, start_new_session=True)
        try:
            out, err, overflow, timed_out, status, cpu = _watch(proc, limits, start)
        finally:
            if proc.returncode is None:  # _watch failed (in this process): the run must not outlive the call
                _kill(proc.pid)
                proc.wait()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = (out + err)[: limits.output_bytes].decode("utf-8", "replace")
    truncated = overflow or len(out) + len(err) > limits.output_bytes
    if truncated:
        text += ("" if text.endswith("\n") else "\n") + f"[output truncated to {limits.output_bytes} bytes]\n"
    error = _error_line(limits, overflow, timed_out, status, cpu)
    return SandboxResult(output=text, error=error, truncated=truncated, seconds=time.monotonic() - start)


def _make_base(code: str) -> str:
    """A fresh directory: ``work/`` (the scratch dir, with ``main.py``) and ``root/`` (the new root's mount point)."""
    base = os.path.realpath(tempfile.mkdtemp(prefix="offgrpo-sandbox-"))
    os.mkdir(f"{base}/work")
    os.mkdir(f"{base}/root")
    Path(f"{base}/work/main.py").write_bytes(code.encode("utf-8", "replace"))  # a lone surrogate: "?"
    return base


def _argv(base: str, limits: SandboxLimits, layers: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-I", "-S", "-B", "-X", "utf8", str(_BOOT), base, str(_cpu_limit(limits)),
            str(limits.memory_bytes), str(limits.file_bytes), ",".join(layers)]


def _cpu_limit(limits: SandboxLimits) -> int:
    """RLIMIT_CPU counts whole seconds: ``cpu_seconds`` rounded up."""
    return max(1, math.ceil(limits.cpu_seconds))


def _env(base: str) -> dict[str, str]:
    """The child's whole environment: nothing of ours (tokens, paths), its scratch dir as HOME and TMPDIR."""
    return {"PATH": "/usr/bin:/bin", "HOME": f"{base}/work", "TMPDIR": f"{base}/work", "LANG": "C.UTF-8"}


def _watch(proc: subprocess.Popen, limits: SandboxLimits, start: float):
    """Read the child's output (bounded) until it exits, overflows or times out; kill what is left and reap it.

    Returns:
        (stdout, stderr, overflow, timed_out, exit code (negative: killed by that signal), CPU seconds used).
    """
    pidfd = os.pidfd_open(proc.pid)  # readable once the child has exited; nothing else to poll
    kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    seen, exited, deadline = 0, False, start + limits.wall_seconds
    with selectors.DefaultSelector() as sel:

        def read(fd: int) -> bool:  # one chunk; True once more than output_bytes came (never kept beyond that)
            nonlocal seen
            data = os.read(fd, 65536)
            if not data:
                sel.unregister(fd)
            seen += len(data)
            kept[fd] += data[: max(0, limits.output_bytes - len(kept[fd]))]
            return seen > limits.output_bytes

        for fd in (*kept, pidfd):
            sel.register(fd, selectors.EVENT_READ)
        overflow = timed_out = False
        while not (exited or overflow or timed_out):
            timed_out = time.monotonic() >= deadline
            for key, _ in sel.select(max(0.0, deadline - time.monotonic())):
                exited = exited or key.fd == pidfd
                overflow = overflow or (key.fd != pidfd and read(key.fd))
        _kill(proc.pid)  # the leader is alive or a zombie (not reaped yet): its group id cannot have been reused
        sel.unregister(pidfd)
        drain_until = time.monotonic() + 1.0  # all killed: the pipes reach EOF at once, unless a process escaped
        while not overflow and sel.get_map() and time.monotonic() < drain_until:
            for key, _ in sel.select(0.1):
                overflow = overflow or read(key.fd)
    os.close(pidfd)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    proc.stdout.close()
    proc.stderr.close()
    out, err = (bytes(buf) for buf in kept.values())
    return out, err, overflow, timed_out and not exited, proc.returncode, usage.ru_utime + usage.ru_stime


def _kill(sid: int) -> None:
    """SIGKILL the process group ``sid`` and every process of session ``sid`` (one may have left the group)."""
    try:
        os.killpg(sid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == sid:
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()  # after "pid (comm)": state ppid pgrp session ...
            if int(fields[3]) == sid:
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile


def _error_line(limits: SandboxLimits, overflow: bool, timed_out: bool, status: int, cpu: float) -> str | None:
    """The one line the model reads about how the run ended; None for a clean exit."""
    cpu_limit = _cpu_limit(limits)
    if timed_out:
        return f"timed out after {limits.wall_seconds:g} s (wall clock)"
    if overflow:
        return f"output limit ({limits.output_bytes} bytes) exceeded; the run was stopped"
    if status == 0:
        return None
    if status == -signal.SIGXCPU or (status == -signal.SIGKILL and cpu >= cpu_limit):
        return f"CPU time limit ({cpu_limit} s) exceeded"
    if status < 0:
        name = {s.value: s.name for s in signal.Signals}.get(-status)
        return f"killed by signal {-status}" + (f" ({name})" if name else "")
    kind = boot.KINDS[status - boot.EXIT_BASE] if 0 <= status - boot.EXIT_BASE < len(boot.KINDS) else None
    if kind == "memory":
        return f"memory limit ({_size(limits.memory_bytes)}) exceeded"
    if kind == "file_size":
        return f"file size limit ({_size(limits.file_bytes)}) exceeded"
    return boot.REFUSALS[kind] if kind else f"exit status {status}"


def _size(n: int) -> str:
    """512 MiB, 64 KiB or 1000 bytes."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"
