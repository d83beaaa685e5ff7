"""The code sandbox (envs/_sandbox.py): what the model sees of each limit and refusal, and that nothing of a hostile
run survives it or reaches the caller's files (each run: ~0.1 s; the CPU and wall-clock cases: ~1 s each).

Three ways to run: ``run_python`` (every layer); ``hook`` (the audit hook alone: a container that forbids user
namespaces and seccomp); ``kernel`` (namespaces, seccomp and rlimits, no hook: the kernel boundary on its own).
"""

from __future__ import annotations

import dis
import functools
import os
import re
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from megatron_offgrpo.envs import SandboxLimits, _sandbox, _sandbox_boot
from megatron_offgrpo.envs._sandbox import SandboxResult, run_python

FAST = SandboxLimits(cpu_seconds=2, wall_seconds=5)
SID = "import os\nprint('sid', os.getsid(0), flush=True)\n"  # the run's session id, to look for survivors
KERNEL = ("net_namespace", "fs_namespace", "seccomp")


def hook_only(code: str, limits: SandboxLimits = FAST) -> SandboxResult:
    return _sandbox._run(code, limits, ("audit_hook",))


def kernel_only(code: str, limits: SandboxLimits = FAST) -> SandboxResult:
    if not set(KERNEL) <= set(_sandbox._active_layers()):
        pytest.skip(f"this machine lacks {set(KERNEL) - set(_sandbox._active_layers())}")
    return _sandbox._run(code, limits, KERNEL)


@pytest.fixture
def contained():
    """Runs a hostile code; afterwards no child of ours and no process of the run's session may be left."""
    ours = psutil.Process()
    before = {p.pid for p in ours.children(recursive=True)}

    def check(run, code: str, limits: SandboxLimits = FAST) -> SandboxResult:
        start = time.monotonic()
        result = run(SID + code, limits)
        assert time.monotonic() - start < limits.wall_seconds + 3, result  # bounded, kill and reap included
        assert {p.pid for p in ours.children(recursive=True)} <= before
        found = re.search(r"^sid (\d+)$", result.output, re.M)
        assert found, result.output
        sid = int(found.group(1))
        survivors = []
        for pid in psutil.pids():
            try:
                survivors += [pid] if os.getsid(pid) == sid else []
            except OSError:
                continue
        assert survivors == [], f"processes of the sandbox's session {sid} survived: {survivors}"
        return result

    return check


def test_calculator_modules_and_output():
    result = run_python(
        "import math, fractions, decimal, statistics, itertools, json, re, hashlib, zlib\n"
        "print(math.comb(5, 2), fractions.Fraction(1, 3) + fractions.Fraction(1, 6), decimal.Decimal('0.1') * 3)\n"
        "print(statistics.mean([1, 2, 6]), sum(itertools.accumulate([1, 2, 3])), json.dumps({'a': 1}))\n"
        "open('notes.txt', 'w').write('kept in scratch')\nprint(open('notes.txt').read())\n"
    )
    # C(5,2) = 10; 1/3 + 1/6 = 1/2; 0.1 * 3 = 0.3; mean = 3; 1 + 3 + 6 = 10
    assert result == SandboxResult("10 1/2 0.3\n3 10 {\"a\": 1}\nkept in scratch\n", None, False, result.seconds)
    assert result.for_model() == result.output


def test_for_model_and_errors_of_ordinary_failures():
    failed = run_python("print('partial')\n1/0\n")
    assert failed.error == "exit status 1"
    assert failed.output.startswith("partial\nTraceback (most recent call last):\n  File \"main.py\", line 2")
    assert "_sandbox_boot" not in failed.output  # the model sees its own frames only
    assert failed.for_model().endswith("ZeroDivisionError: division by zero\nerror: exit status 1")
    assert run_python("import sys; sys.exit(3)").for_model() == "error: exit status 3"
    assert run_python("pass").for_model() == "(no output)"
    assert "SyntaxError" in run_python("print(1").output
    assert run_python("import faulthandler\nfaulthandler._sigsegv()").error == "killed by signal 11 (SIGSEGV)"


def test_limits_validate():
    with pytest.raises(ValueError, match="cpu_seconds=0"):
        SandboxLimits(cpu_seconds=0)
    with pytest.raises(ValueError, match="needs >= 64 MiB"):
        SandboxLimits(memory_bytes=2**20)


def test_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("OFFGRPO_TEST_TOKEN", "s3cret-token")
    result = run_python("import os, sys\nprint(sorted(os.environ), sys.path)")
    assert "s3cret" not in result.output and "OFFGRPO" not in result.output
    assert "site-packages" not in result.output and result.error is None


def test_overhead_median_of_ten():
    run_python("print(1 + 1)")  # the first call probes the layers once
    seconds = []
    for _ in range(10):
        start = time.monotonic()
        assert run_python("print(1 + 1)").output == "2\n"
        seconds.append(time.monotonic() - start)
    print(f"sandbox overhead: median {statistics.median(seconds) * 1e3:.0f} ms over 10 runs of print(1 + 1)")
    assert statistics.median(seconds) < 0.5


def test_concurrent_calls_from_threads():
    results = [None] * 4

    def work(i):
        results[i] = run_python(f"print({i} * 7)")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.output for r in results] == [f"{i * 7}\n" for i in range(4)]


LIMITS = [  # (code, limits, error line)
    ("while True: pass", SandboxLimits(cpu_seconds=1, wall_seconds=30), "CPU time limit (1 s) exceeded"),
    ("import time\ntime.sleep(60)", SandboxLimits(wall_seconds=1), "timed out after 1 s (wall clock)"),
    ("x = bytearray(10**10)", FAST, "memory limit (512 MiB) exceeded"),
    ("x = []\nwhile True: x.append(bytearray(10**6))", SandboxLimits(memory_bytes=128 * 2**20),
     "memory limit (128 MiB) exceeded"),
    ("open('big', 'wb').write(b'x' * 2**21)", FAST, "file size limit (1 MiB) exceeded"),
    ("while True: print('spam')", FAST, "output limit (4096 bytes) exceeded; the run was stopped"),
    ("print('x' * 10**8)", FAST, "output limit (4096 bytes) exceeded; the run was stopped"),
    ("print('x' * 10**9)", FAST, "memory limit (512 MiB) exceeded"),  # 1 GB: the string cannot even be made
]
LIMIT_IDS = ["cpu", "wall", "bytearray", "growing-list", "file-size", "print-loop", "huge-print",
             "huger-print"]


@pytest.mark.parametrize(("code", "limits", "error"), LIMITS, ids=LIMIT_IDS)
def test_limits(contained, code, limits, error):
    result = contained(run_python, code, limits)
    assert result.error == error, result.output
    assert result.for_model().endswith(f"error: {error}")
    if "output" in error:
        assert result.truncated and result.output.endswith("[output truncated to 4096 bytes]\n")
        assert len(result.output.encode()) <= 4096 + 40


@pytest.mark.parametrize(("run", "error"), [(run_python, "process creation is not allowed"),
                                            (hook_only, "process creation is not allowed"),
                                            (kernel_only, "exit status 1")], ids=["all-layers", "hook", "kernel"])
def test_fork_bomb(contained, run, error):
    result = contained(run, "import os\nwhile True: os.fork()")
    assert result.error == error, result.output
    assert result.output.rstrip().endswith(("PermissionError: process creation is not allowed (sandbox: os.fork)",
                                            "PermissionError: [Errno 1] Operation not permitted"))


def test_error_lines():
    limits = SandboxLimits(cpu_seconds=2.5, wall_seconds=7, memory_bytes=96 * 2**20, file_bytes=1000)
    line = functools.partial(_sandbox._error_line, limits, False, False)
    assert line(-signal.SIGXCPU, 3.0) == "CPU time limit (3 s) exceeded"  # RLIMIT_CPU: 2.5 s rounded up
    assert line(-signal.SIGKILL, 4.0) == "CPU time limit (3 s) exceeded"  # SIGXCPU ignored: SIGKILL at soft + 1
    assert line(-signal.SIGKILL, 0.2) == "killed by signal 9 (SIGKILL)"
    assert line(-40, 0.0) == "killed by signal 40"  # a real-time signal: no name
    assert line(_sandbox_boot.EXIT_BASE + _sandbox_boot.KINDS.index("memory"), 0.1) == "memory limit (96 MiB) exceeded"
    assert line(_sandbox_boot.EXIT_BASE + _sandbox_boot.KINDS.index("file_size"), 0.1) == (
        "file size limit (1000 bytes) exceeded")
    assert line(2, 0.1) == "exit status 2" and line(0, 0.1) is None
    assert _sandbox._error_line(limits, True, True, -9, 0.0) == "timed out after 7 s (wall clock)"
    assert _sandbox._error_line(limits, True, False, -9, 0.0) == "output limit (4096 bytes) exceeded; the run was " \
                                                                 "stopped"


def test_files_written_in_scratch_are_bounded(contained):
    result = contained(run_python, "for i in range(1000):\n    open(f'f{i}', 'w').close()")
    assert result.error == f"too many files written (at most {_sandbox_boot.MAX_WRITES})"


@pytest.fixture
def secret(tmp_path) -> Path:
    path = tmp_path / "secret.txt"
    path.write_text("the-run's-secret")
    return path


ROUTES = {  # kind: the ways a code may try it ({secret}: a file of the caller's, outside the scratch dir)
    "process": ["os.fork()", "os.system('echo hi')", "os.posix_spawn('/bin/true', ['true'], dict())",
                "os.execv('/bin/true', ['true'])", "import subprocess", "import pty", "import multiprocessing",
                "os.forkpty()"],
    "signal": ["os.kill(os.getppid(), 0)", "os.killpg(os.getpgid(0), 0)"],
    "network": ["import socket", "__import__('_socket')", "import urllib.request", "import ssl"],
    "file": ["print(open({secret!r}).read())", "open({secret!r}, 'a').write('x')", "os.remove({secret!r})",
             "os.rename({secret!r}, 'stolen')", "os.link({secret!r}, 'hard')", "os.symlink({secret!r}, 'soft')",
             "print(os.listdir('/work'))", "print(os.listdir({home!r}))", "os.chdir('/')",
             "open('/proc/self/mem', 'rb')", "open('/etc/passwd')", "open('../../../../../../etc/hostname')",
             "os.makedirs('d', exist_ok=True); open('d')"],  # no directory fd: dir_fd would dodge the checks
    "native": ["import ctypes", "_imp.create_dynamic(importlib.machinery.ModuleSpec('evil', None, origin='e.so'))"],
    "thread": ["threading.Thread(target=print).start()", "_thread.start_new_thread(print, ())",
               "del sys.modules['_thread']; import _thread"],
    "internals": ["sys.settrace(lambda *a: None)", "sys.setprofile(lambda *a: None)",
                  "(lambda: 0).__code__.replace(co_code=b'')", "f = lambda x=1: x; f.__defaults__ = (2,)",
                  "import _xxsubinterpreters", "import _testcapi",
                  "resource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "os.mknod('node')",
                  "del sys.modules['posix']; import posix", "import gc; gc.get_objects()",
                  "import gc; gc.get_referents(sys)"],
}


def routes_script(routes: list[str]) -> str:
    """Try each route, print its refusal; the last one is left uncaught (it makes the run's error line)."""
    lines = ["import os, sys, threading, _thread, _imp, importlib.machinery, resource"]
    for code in routes[:-1]:
        lines += ["try:", f"    {code}", "except (PermissionError, AttributeError) as e:",
                  "    print('refused', type(e).__name__, e)", "else:", f"    print('ALLOWED', {code!r})"]
    return "\n".join([*lines, routes[-1]])


@pytest.mark.parametrize("run", [run_python, hook_only], ids=["all-layers", "audit-hook-only"])
@pytest.mark.parametrize("kind", list(ROUTES))
def test_refused(contained, secret, run, kind):
    routes = [r.format(secret=str(secret), home=str(secret.parent)) for r in ROUTES[kind]]
    result = contained(run, routes_script(routes))
    message = _sandbox_boot.REFUSALS[kind]
    assert result.error == message, result.output  # the error line: the first refusal
    assert "ALLOWED" not in result.output, result.output
    refused = re.findall(r"^refused (\w+) (.*)$", result.output, re.M)
    assert len(refused) == len(routes) - 1, result.output
    for (name, text), route in zip(refused, routes):
        if route == "os.mknod('node')":  # gone altogether: it raises no audit event, and would make device nodes
            assert (name, text) == ("AttributeError", "module 'os' has no attribute 'mknod'")
        else:
            assert name == "PermissionError" and text.startswith(f"{message} (sandbox: "), (route, text)
    last = result.output.rstrip().splitlines()[-1]  # the uncaught one, as the model reads it
    assert last.startswith(f"PermissionError: {message} (sandbox: "), result.output
    assert "the-run's-secret" not in result.output
    assert secret.read_text() == "the-run's-secret" and sorted(os.listdir(secret.parent)) == ["secret.txt"]


def test_refusal_caught_by_the_code_is_not_an_error():
    result = run_python("try:\n    import socket\nexcept PermissionError as e:\n    print('no network:', e)\n")
    assert result.error is None and result.output.startswith("no network: network access is not allowed")


def test_reads_allowed_in_the_standard_library_only():
    venv_file = Path(psutil.__file__)  # site-packages of the caller's environment
    result = hook_only(f"import os\nprint(len(open(os.__file__).read()) > 0)\nopen({str(venv_file)!r})")
    assert result.output.startswith("True\n") and result.error == "file access outside the working directory is " \
                                                                 "not allowed", result.output


KERNEL_CASES = {  # the kernel alone (no audit hook): what the code gets back from the OS
    "os.fork()": "PermissionError: [Errno 1] Operation not permitted",  # seccomp
    "socket.socket()": "PermissionError: [Errno 1] Operation not permitted",  # seccomp
    "os.kill(os.getppid(), 0)": "PermissionError: [Errno 1] Operation not permitted",  # seccomp
    "print(open({secret!r}).read())": "FileNotFoundError",  # the mount namespace: not there at all
    "print(os.path.exists({home!r}), os.path.exists('/proc/1'))": "False False",
    "open('/tmp/escaped', 'w')": "OSError: [Errno 30] Read-only file system",
    "resource.setrlimit(resource.RLIMIT_CPU, (100, 100))": "ValueError: not allowed to raise maximum limit",
    "print(lib.unshare(0x10000000), ctypes.get_errno())": "-1 1",  # EPERM: seccomp
    # a thread with a network namespace of its own (were it allowed, the stack-less thread would crash the run)
    f"print('thread', lib.syscall({_sandbox_boot._CLONE[os.uname().machine != 'x86_64']}, 0x40010900, 0, 0, 0, 0), "
    "ctypes.get_errno())": "thread -1 1",
    "sp = os.path.dirname(os.__file__) + '/site-packages'; print('packages', os.listdir(sp) if os.path.isdir(sp) "
    "else [])": "packages []",  # the base interpreter's installed packages: hidden under an empty tmpfs
}


def test_kernel_layers_alone(contained, secret):
    lines = ["import os, resource, socket, ctypes", "lib = ctypes.CDLL(None, use_errno=True)"]
    for code in KERNEL_CASES:
        code = code.format(secret=str(secret), home=str(secret.parent))
        lines += ["try:", f"    {code}", "except Exception as e:", "    print(type(e).__name__ + ':', e)"]
    result = contained(kernel_only, "\n".join(lines))
    assert result.error is None, result.output
    for expected in KERNEL_CASES.values():
        assert expected in result.output, (expected, result.output)
    assert "the-run's-secret" not in result.output
    assert secret.read_text() == "the-run's-secret" and not os.path.exists("/tmp/escaped")


def test_hook_code_looks_up_no_global():
    """User code can rebind any global or builtin; the hook and its path resolver must not read one."""
    record: list[str] = []
    hook = _sandbox_boot._hook_for("/nonexistent/work", ("/nonexistent/lib",), record)
    resolve = hook.__defaults__[0]
    # nor may it hold a mutable table: its frames (a refusal's traceback) show its defaults to the code
    assert [d for d in hook.__defaults__ if isinstance(d, (dict, list, set)) and d is not record] == []
    for fn in (hook, resolve):
        assert fn.__closure__ is None and fn.__kwdefaults__ is None
        loads = {i.opname for i in dis.get_instructions(fn)} & {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF",
                                                                 "LOAD_CLASSDEREF", "LOAD_CLOSURE"}
        assert loads == set(), (fn.__name__, loads)
        assert not [c for c in fn.__code__.co_consts if hasattr(c, "co_code")]  # no nested function or genexpr


@pytest.fixture
def hook(tmp_path):
    """The audit hook, called directly (not installed): scratch = tmp_path/work, the standard library readable."""
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "to_etc").symlink_to("/etc/passwd")
    (tmp_path / "work" / "dir").mkdir()
    record: list[str] = []
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    fn = _sandbox_boot._hook_for(str(tmp_path / "work"), (stdlib,), record)

    def call(event: str, *args) -> str | None:
        try:
            fn(event, tuple(args))
        except PermissionError:
            return record[-1]
        return None

    return call, tmp_path / "work", stdlib


class Lying(str):
    def startswith(self, *args):  # the hook must not ask a str subclass anything
        return True


W, R = os.O_WRONLY | os.O_CREAT | os.O_TRUNC, os.O_RDONLY


def test_hook_decisions(hook):
    call, work, stdlib = hook
    assert call("open", str(work / "a.txt"), "w", W) is None
    assert call("open", "a.txt", "w", W) is None  # relative: against the scratch dir
    assert call("open", str(work / "a.txt").encode(), "w", W) is None
    assert call("open", 3, "r", R) is None  # an open descriptor
    assert call("open", os.path.join(stdlib, "os.py"), "r", R) is None
    assert call("open", os.path.join(stdlib, "os.py"), "a", os.O_WRONLY | os.O_APPEND) == "file"
    assert call("open", "/etc/passwd", "r", R) == "file"
    assert call("open", os.path.join(stdlib, "site-packages", "x.py"), "r", R) == "file"  # not the stdlib
    assert call("open", psutil.__file__, "r", R) == "file"
    assert call("open", "../a.txt", "r", R) == "file"
    assert call("open", "to_etc", "r", R) == "file"  # a symlink inside scratch, resolved
    assert call("open", "dir", "r", R) == "file"  # directories: no fd for dir_fd tricks
    assert call("open", Lying("/etc/passwd"), "r", R) == "file"
    assert call("open", object(), "r", R) == "file"
    assert call("os.listdir", None) is None and call("os.listdir", stdlib) is None
    assert call("os.listdir", "/work") == "file"
    assert call("os.rename", "a.txt", "b.txt", -1, -1) is None
    assert call("os.rename", "a.txt", "/tmp/b.txt", -1, -1) == "file"
    assert call("os.link", "/etc/passwd", "l", -1, -1) == "file"
    assert call("import", "json", None, [], [], []) is None
    assert call("import", "math", os.path.join(stdlib, "lib-dynload", "math.so"), None, None, None) is None
    assert call("import", "evil", str(work / "evil.so"), None, None, None) == "native"
    assert call("import", "np", os.path.join(stdlib, "site-packages", "np.so"), None, None, None) == "native"
    assert call("import", "ctypes.util", None, [], [], []) == "native"
    assert call("import", "_testcapi", None, [], [], []) == "internals"
    assert call("socket.getaddrinfo", "example.com", 80, 0, 0, 0) == "network"
    assert call("subprocess.Popen", "ls", ["ls"], None, None) == "process"
    assert call("object.__setattr__", Lying, "x", 1) is None  # class attributes: ordinary code
    assert call("object.__setattr__", test_hook_decisions, "__code__", None) == "internals"
    assert call("compile", b"1", "<string>") is None


def test_hook_counts_writes(hook):
    call, work, _ = hook
    for i in range(_sandbox_boot.MAX_WRITES):
        assert call("open", f"f{i}", "w", W) is None
    assert call("open", "one-more", "w", W) == "file_count"
    assert call("open", "f0", "r", R) is None  # reading stays allowed


def test_layers_on_this_machine():
    """Which layers work here (the report names them); the hook works everywhere."""
    layers = _sandbox._active_layers()
    print(f"sandbox layers active on this machine: {layers} (uid {os.getuid()}, {sys.platform})")
    assert "audit_hook" in layers
