"""The sandbox's child side: started as ``python -I -S -B _sandbox_boot.py BASE CPU MEMORY FSIZE LAYERS``.

``main`` walls the process in, then runs ``BASE/work/main.py`` as a fresh ``__main__``. In order: (1) namespaces:
no network; a root holding only the standard library, the system libraries and the scratch dir; (2) rlimits;
(3) a seccomp filter, which also forbids undoing (1) and (2); (4) the audit hook, which refuses with one clear line.
``_sandbox``'s docstring says what each layer guards and what it does not. The parent imports this module for its
constants only (importing it runs nothing). Standard library only: the child runs without site-packages.
"""

from __future__ import annotations

import os
import sys

# What a refusal or a limit is, by kind; a run that ends on one exits with EXIT_BASE + KINDS.index(kind), which the
# parent turns into the error line (``_sandbox._error_line``). Only the first refusal of a run is reported.
MAX_WRITES = 256  # files opened for writing per run: bounds the disk a run can fill (RLIMIT_FSIZE bounds each file)
REFUSALS = {
    "network": "network access is not allowed",
    "process": "process creation is not allowed",
    "signal": "sending signals is not allowed",
    "file": "file access outside the working directory is not allowed",
    "file_count": f"too many files written (at most {MAX_WRITES})",
    "native": "native code (ctypes, extension modules outside the standard library) is not allowed",
    "thread": "threads are not allowed",
    "internals": "changing the interpreter's internals is not allowed",
}
KINDS = (*REFUSALS, "memory", "file_size")
EXIT_BASE = 100
LAYERS = ("net_namespace", "fs_namespace", "seccomp", "audit_hook")  # all on by default; tests switch some off
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

# Audit events refused outright, by kind (prefixes end with a dot). Events not named here are allowed, except the
# path events below, which are checked, and ``import``.
_EVENTS = {
    "os.fork": "process", "os.forkpty": "process", "os.exec": "process", "os.posix_spawn": "process",
    "os.spawn": "process", "os.system": "process", "os.startfile": "process", "subprocess.": "process",
    "os.kill": "signal", "os.killpg": "signal", "signal.pthread_kill": "signal",
    "socket.": "network", "ctypes.": "native",
    "_thread.start_new_thread": "thread",  # from Python 3.12; before, ``main`` replaces the function itself
    # chdir: the hook resolves relative paths against the scratch dir, which must stay the cwd. symlink: with none
    # in scratch, nothing the hook resolved can be re-pointed between its check and the open.
    "os.chdir": "file", "os.symlink": "file",
    # A tracer can jump over the hook's ``raise``; crafted code objects can corrupt memory; new interpreters start
    # without this hook; raised limits would lift step 2 where seccomp is missing.
    "sys.settrace": "internals", "sys.setprofile": "internals", "code.__new__": "internals",
    "cpython.PyInterpreterState_New": "internals", "resource.setrlimit": "internals", "resource.prlimit": "internals",
    # the hook's own objects must stay out of reach (gc.get_referents of a read-only mapping gives its dict)
    "gc.get_objects": "internals", "gc.get_referrers": "internals", "gc.get_referents": "internals",
}
_READ_EVENTS = {"os.listdir": (0,), "os.scandir": (0,), "os.getxattr": (0,), "os.listxattr": (0,)}
_WRITE_EVENTS = {"os.mkdir": (0,), "os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.link": (0, 1),
                 "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,), "os.utime": (0,), "os.setxattr": (0,),
                 "os.removexattr": (0,), "os.chflags": (0,), "os.lchflags": (0,)}
_IMPORTS = {  # top-level module names whose import is refused (their dangerous calls raise no audit event)
    "ctypes": "native", "_ctypes": "native", "socket": "network", "_socket": "network", "ssl": "network",
    "_ssl": "network", "subprocess": "process", "_posixsubprocess": "process", "multiprocessing": "process",
    "_multiprocessing": "process", "pty": "process", "concurrent": "thread", "_xxsubinterpreters": "internals",
    "_ctypes_test": "internals",  # and every "_test*" module (the hook checks the prefix): C API test helpers
    # Already imported at startup: importing them again would bring back what ``main`` removes from them.
    "posix": "internals", "_thread": "thread",
}

# Syscall numbers (asm/unistd_64.h; asm-generic/unistd.h for aarch64). Refused with EPERM; clone only with
# CLONE_THREAD (a thread, which dies with the process) and no CLONE_NEW* flag; kill/tkill/tgkill only towards this
# process; clone3 with ENOSYS (its flags are behind a pointer), so that libc falls back to clone.
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_SYSCALLS = {  # name: (x86_64, aarch64)
    "fork": (57, None), "vfork": (58, None), "execve": (59, 221), "execveat": (322, 281), "socket": (41, 198),
    "socketpair": (53, 199), "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41),
    "chroot": (161, 51), "mount_setattr": (442, 442), "open_tree": (428, 428), "move_mount": (429, 429),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427), "bpf": (321, 280),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "keyctl": (250, 219), "add_key": (248, 217),
    "request_key": (249, 218), "kexec_load": (246, 104), "kexec_file_load": (320, 294), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "reboot": (169, 142), "swapon": (167, 224),
    "swapoff": (168, 225), "mknod": (133, None), "mknodat": (259, 33), "pidfd_send_signal": (424, 424),
    "pidfd_open": (434, 434), "pidfd_getfd": (438, 438), "kcmp": (312, 272), "process_madvise": (440, 440),
    "setrlimit": (160, 164), "prlimit64": (302, 261), "clock_settime": (227, 112), "settimeofday": (164, 170),
    "adjtimex": (159, 171), "clock_adjtime": (305, 266), "sethostname": (170, 161), "setdomainname": (171, 162),
    "acct": (163, 89), "syslog": (103, 116), "iopl": (172, None), "ioperm": (173, None),
}
_OWN_PID_ONLY = {"kill": (62, 129), "tkill": (200, 130), "tgkill": (234, 131)}
_CLONE, _CLONE3 = (56, 220), (435, 435)
_CLONE_NEW = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET


def main(argv: list[str]) -> int:
    """Wall the process in (module docstring), then run the code; returns the exit status."""
    base, cpu, memory, fsize, layers = argv[1], int(argv[2]), int(argv[3]), int(argv[4]), argv[5].split(",")
    scratch = os.path.realpath(base + "/work")  # the hook compares resolved paths
    roots = tuple(os.path.realpath(p) for p in sys.path if os.path.isdir(p) and "-packages" not in p)  # stdlib
    os.chdir(scratch)
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    active = _namespaces(base, scratch, roots, layers)
    _limits(cpu, memory, fsize)
    if "seccomp" in layers and _seccomp():
        active.append("seccomp")
    for name in [m for m in sys.modules if m.partition(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[name]  # re-importing them raises an ``import`` event, which the hook refuses
    for module in (os, sys.modules["posix"]):  # no audit event: a device node would pass the hook's path check
        for name in ("mknod", "mkfifo"):
            module.__dict__.pop(name, None)
    record: list[str] = []
    if "audit_hook" in layers:
        sys.addaudithook(_hook_for(scratch, roots, record))
        _no_threads(record)
        active.append("audit_hook")
    if "probe" in layers:
        print(",".join(active))
        return 0
    return _run(source, record)


def _namespaces(base: str, scratch: str, roots: tuple[str, ...], layers: list[str]) -> list[str]:
    """Enter new user + network (+ mount) namespaces; the active layers (none where namespaces are forbidden)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    flags = 0x10000000 | (0x40000000 if "net_namespace" in layers else 0) | (
        0x00020000 if "fs_namespace" in layers else 0)  # CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS
    uid, gid = os.getuid(), os.getgid()
    if flags == 0x10000000 or libc.unshare(flags) != 0:
        return []
    try:  # map our own ids (the only mapping allowed unprivileged): the tmpfs below cannot own unmapped files
        for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError:
        layers = [name for name in layers if name != "fs_namespace"]
    active = ["net_namespace"] if "net_namespace" in layers else []
    if "fs_namespace" in layers:
        try:
            _new_root(libc, base + "/root", scratch, roots)
            active.append("fs_namespace")
        except OSError:  # before pivot_root nothing is visible to the code yet: the hook still guards files
            os.chdir(scratch)
    return active


def _new_root(libc, root: str, scratch: str, roots: tuple[str, ...]) -> None:
    """Pivot into an empty tmpfs holding read-only binds of ``roots`` and the system libraries, and ``scratch``."""
    import ctypes
    import struct

    def check(result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    def setattr_(path: str, attr_set: int, attr_clr: int = 0, recursive: bool = True) -> None:
        attr = ctypes.create_string_buffer(struct.pack("QQQQ", attr_set, attr_clr, 0, 0), 32)  # struct mount_attr
        check(libc.syscall(442, -100, path.encode(), 0x8000 if recursive else 0, attr, 32), "mount_setattr " + path)

    ro_nosuid_nodev = 0x1 | 0x2 | 0x4  # MOUNT_ATTR_RDONLY | NOSUID | NODEV
    check(libc.mount(None, b"/", None, 0x4000 | 0x40000, None), "make / private")  # MS_REC | MS_PRIVATE
    check(libc.mount(b"tmpfs", root.encode(), b"tmpfs", 0x2 | 0x4, b"size=1m,mode=0755"), "tmpfs")
    binds = [(d, True) for d in roots] + [(scratch, False)]
    for path in ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/etc/ld.so.cache"):  # libc's search for dlopen
        if os.path.islink(path):
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(os.readlink(path), root + path)
        elif os.path.exists(path):
            binds.append((path, True))
    for path, readonly in binds:
        if os.path.isdir(path):
            os.makedirs(root + path, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            open(root + path, "w").close()
        check(libc.mount(path.encode(), (root + path).encode(), None, 0x1000 | 0x4000, None), "bind " + path)
        setattr_(root + path, ro_nosuid_nodev if readonly else 0x2 | 0x4)
    for path in [f"{d}/{name}" for d in roots for name in ("site-packages", "dist-packages")]:
        if os.path.isdir(path):  # installed packages are not the standard library: an empty read-only dir instead
            check(libc.mount(b"tmpfs", (root + path).encode(), b"tmpfs", 0x1 | 0x2 | 0x4, b"size=4k"), "hide " + path)
    setattr_(root, 0x1, recursive=False)
    os.chdir(root)
    arch = 0 if os.uname().machine == "x86_64" else 1
    check(libc.syscall(_SYSCALLS["pivot_root"][arch], b".", b"."), "pivot_root")
    check(libc.umount2(b".", 0x2), "detach the old root")  # MNT_DETACH
    os.chdir(scratch)
    # A namespace owned by a less privileged user namespace locks what it inherits: the read-only flags set above
    # can no longer be cleared, even by this process's root-in-namespace (seccomp forbids trying, too).
    check(libc.unshare(0x10000000 | 0x00020000), "lock the mounts")


def _limits(cpu: int, memory: int, fsize: int) -> None:
    """Kernel resource limits; set before seccomp, which then forbids raising them (root could)."""
    import ctypes
    import resource

    # No core dump, even where core_pattern pipes to a helper (apport, systemd-coredump), which ignores RLIMIT_CORE.
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    # SIGXCPU at the soft limit; SIGKILL a second later, at the hard one, if the code ignores SIGXCPU. (Soft = hard
    # would SIGKILL at once, but then the parent could tell the CPU limit only from the rusage, which can fall short.)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))  # Python ignores SIGXFSZ: writes fail with EFBIG
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    # No process at all; the kernel does not apply this one to root (uid 0), hence the seccomp filter and the hook.
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))


def _seccomp() -> bool:
    """Install the syscall filter (module docstring, step 3); False where the machine is not supported or refuses."""
    import ctypes
    import struct

    machine = os.uname().machine
    if machine not in _AUDIT_ARCH:
        return False
    arch = 0 if machine == "x86_64" else 1
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    allow, eperm, enosys, kill = 0x7FFF0000, 0x00050001, 0x00050026, 0x80000000  # SECCOMP_RET_*
    # (code, k, jump-if-true label, jump-if-false label); labels resolve to forward offsets below.
    prog = [(ld, 4, None, None), (jeq, _AUDIT_ARCH[machine], None, "kill"), (ld, 0, None, None)]
    if arch == 0:
        prog.append((jge, 0x40000000, "deny", None))  # the x32 ABI: same arch value, other numbers
    prog += [(jeq, nrs[arch], "deny", None) for nrs in _SYSCALLS.values() if nrs[arch] is not None]
    prog += [(jeq, nrs[arch], "own_pid", None) for nrs in _OWN_PID_ONLY.values()]
    prog += [(jeq, _CLONE[arch], "clone", None), (jeq, _CLONE3[arch], "enosys", None), (ret, allow, None, None)]
    labels = {"clone": len(prog), "own_pid": len(prog) + 3, "allow": len(prog) + 5, "deny": len(prog) + 6,
              "enosys": len(prog) + 7, "kill": len(prog) + 8}
    prog += [(ld, 16, None, None), (jset, _CLONE_NEW, "deny", None), (jset, 0x00010000, "allow", "deny"),
             (ld, 16, None, None), (jeq, os.getpid(), "allow", "deny"),
             (ret, allow, None, None), (ret, eperm, None, None), (ret, enosys, None, None), (ret, kill, None, None)]
    code = b"".join(
        struct.pack("HBBI", op, labels[t] - i - 1 if t else 0, labels[f] - i - 1 if f else 0, k)
        for i, (op, k, t, f) in enumerate(prog))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    fprog = Fprog(len(prog), code)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: required to filter without CAP_SYS_ADMIN
        return False
    return libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def _resolver(cwd: str):
    """``os.path.realpath`` for the hook, with no global lookup either (``_hook_for`` says why)."""
    import posix

    def resolve(path, cwd=cwd, lstat=posix.lstat, readlink=posix.readlink, isinstance=isinstance, str=str,
                bytes=bytes, list=list, reversed=reversed, OSError=OSError):
        """A path argument -> absolute path, symlinks followed (os.path.realpath); None for an fd or another type."""
        if isinstance(path, str):
            path = "".join((path,))  # a str subclass's methods could lie; this copies the characters C uses
        elif isinstance(path, bytes):
            path = b"".join((path,)).decode("utf-8", "surrogateescape")
        else:
            return None
        path = path if path[:1] == "/" else cwd + "/" + path
        todo, done, hops = list(reversed(path.split("/"))), [], 0
        while todo:
            part = todo.pop()
            if part == "" or part == ".":
                continue
            if part == "..":
                done = done[:-1]
                continue
            here = "/" + "/".join(done + [part])
            try:
                mode = lstat(here).st_mode
            except OSError:
                mode = 0  # missing: taken literally (a file about to be created)
            if mode & 0o170000 == 0o120000:  # a symlink
                hops += 1
                if hops > 40:
                    return "/..loop"
                target = readlink(here)
                done = [] if target[:1] == "/" else done
                todo.extend(reversed(target.split("/")))
            else:
                done.append(part)
        return "/" + "/".join(done)

    return resolve


def _hook_for(scratch: str, roots: tuple[str, ...], record: list[str]):
    """The audit hook (module docstring, step 4); refused kinds are appended to ``record``.

    The code runs in this interpreter and can rebind any module attribute or builtin (``os.path.realpath = ...``),
    so the hook and its resolver look up no global name at all: everything they use is bound here, as default
    arguments (setting ``__defaults__`` or ``__code__`` is itself refused). ``tests/envs`` checks the bytecode.
    """
    import itertools
    import posix
    from types import MappingProxyType

    writes, resolve = itertools.count(), _resolver(scratch)
    readable = tuple(root + "/" for root in roots)
    hidden = tuple(f"{root}/{name}/" for root in roots for name in ("site-packages", "dist-packages"))
    # Read-only views of private copies: a frame of the hook (a refusal's traceback) shows these to the code.
    events, reads, changes, imports = (MappingProxyType(dict(t)) for t in (_EVENTS, _READ_EVENTS, _WRITE_EVENTS,
                                                                            _IMPORTS))

    def hook(event, args, resolve=resolve, inside=scratch + "/", readable=readable, hidden=hidden, record=record,
             writes=writes, events=events, reads=reads, changes=changes, imports=imports,
             refusals=MappingProxyType(dict(REFUSALS)), lstat=posix.lstat, type=type, int=int, OSError=OSError,
             PermissionError=PermissionError, max_writes=MAX_WRITES, write_flags=_WRITE_FLAGS, next=next):
        kind, detail = events.get(event) or events.get(event[: event.find(".") + 1]), event
        if kind is None and event == "open" and type(args[0]) is not int:
            path = detail = resolve(args[0])
            try:
                mode = 0 if path is None else lstat(path).st_mode
            except OSError:
                mode = 0  # missing: a file about to be created
            where = "" if path is None else path + "/"
            if not where or (mode and mode & 0o170000 != 0o100000):  # regular files only: no directory fd
                kind = "file"
            elif where.startswith(inside):
                kind = "file_count" if args[2] & write_flags and next(writes) >= max_writes else None
            elif args[2] & write_flags or not where.startswith(readable) or where.startswith(hidden):
                kind = "file"
        elif kind is None and (event in reads or event in changes):
            for index in reads.get(event) or changes[event]:
                if type(args[index]) is int:
                    continue  # a descriptor: opened through this hook
                path = resolve(inside if args[index] is None else args[index])  # None: the cwd
                where = "" if path is None else path + "/"
                if not (where.startswith(inside) or (
                        event in reads and where.startswith(readable) and not where.startswith(hidden))):
                    kind, detail = "file", path
        elif kind is None and event == "import":
            kind = imports.get(args[0].partition(".")[0]) or ("internals" if args[0][:5] == "_test" else None)
            if kind is None and args[1] is not None:  # an extension module: native code, from the stdlib only
                path = resolve(args[1])
                where = "" if path is None else path + "/"
                if not where.startswith(readable) or where.startswith(hidden):
                    kind, detail = "native", args[1]
        elif kind is None and event == "object.__setattr__" and args[1] in ("__code__", "__defaults__",
                                                                            "__kwdefaults__"):
            kind = "internals"
        if kind is not None:
            record.append(kind)
            raise PermissionError(f"{refusals[kind]} (sandbox: {detail})")

    return hook


def _no_threads(record: list[str]) -> None:
    """Refuse new threads (Python 3.11 raises no audit event for them): replace ``_thread``'s starter."""
    import _thread

    def start_new_thread(*args, record=record, PermissionError=PermissionError, message=REFUSALS["thread"]):
        record.append("thread")
        raise PermissionError(f"{message} (sandbox: _thread.start_new_thread)")

    _thread.start_new_thread = _thread.start_new = start_new_thread


def _run(source: str, record: list[str]) -> int:
    """Run the code as ``__main__`` in a fresh module; the exit status (EXIT_BASE + kind after a refusal/limit)."""
    import builtins

    module = type(sys)("__main__")
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"], sys.argv = module, ["main.py"]
    try:
        exec(compile(source, "main.py", "exec"), module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:  # printed as Python would, then classified
        kind = record[0] if record else None
        if isinstance(exc, MemoryError):
            module.__dict__.clear()  # free what the code holds, so that the traceback can be printed
            kind = "memory"
        elif kind is None and isinstance(exc, OSError) and exc.errno == 27:  # EFBIG: RLIMIT_FSIZE
            kind = "file_size"
        try:
            _print_traceback(exc)
        except MemoryError:  # the frames of the traceback still hold the memory: the error line says it all
            pass
        return EXIT_BASE + KINDS.index(kind) if kind else 1
    return 0


def _print_traceback(exc: BaseException) -> None:
    """Print ``exc`` as Python would, keeping the frames of the code only (not this file's, not the hook's)."""
    tb, frames = exc.__traceback__, []
    while tb is not None:
        frames += [tb] if tb.tb_frame.f_code.co_filename != __file__ else []
        tb = tb.tb_next
    for tb, after in zip(frames, frames[1:] + [None]):
        tb.tb_next = after
    exc.__traceback__ = frames[0] if frames else None  # what the printer reads
    sys.__excepthook__(type(exc), exc, exc.__traceback__)  # the C printer


if __name__ == "__main__":
    sys.exit(main(sys.argv))
