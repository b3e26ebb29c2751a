"""The isolated Python tool: model-written code runs in its own namespaces, as a host user that
owns nothing, with no network, no children, nothing of the machine but the interpreter, read-only
but its own size-capped folders, resource caps and a timeout. Where that isolation is unavailable
the tool is disabled (it fails closed), unless the user opts in to running model code unisolated.

    python_tool(code, ...)   run one program and return (output, ok); it never raises
    isolation_problem()      None where each call can be isolated here, else the reason
"""

import contextlib
import importlib.util
import json
import os
import platform
import pwd
import random
import select
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Isolation by allow-list, through bubblewrap (`bwrap`, the sandbox behind Flatpak; the Makefile
# installs it where the machine allows). Each call gets new mount, PID, network, IPC, UTS and
# cgroup namespaces and a new session. Its host uid is never 0 nor one that owns anything: a root
# trainer runs bwrap itself (so it binds an interpreter under a folder only root may enter) and
# the boot drops to a host uid drawn per call from CALL_UIDS, which no account, file or process
# has; a normal trainer runs bwrap in a user namespace of its own, where the program is
# SANDBOX_UID, mapped to the trainer's uid, and is the namespace's first process (`--as-pid-1`).
# No capabilities, no user namespace inside. Its root holds only the dynamic libraries
# (/usr/lib*), the interpreter and its venv (read-only, by their real paths), a minimal /dev with
# no pty to take (/dev/pts/ptmx is /dev/null) and its own /proc, all read-only, and size-capped
# tmpfs folders (WORK, the working directory, /tmp and /dev/shm) that exist only inside it: the
# repository, its .git and data, runs/, home folders, /run and every socket path are absent. A
# seccomp filter (`seccomp_filter`) forbids children, namespaces, ptrace and cross-process memory,
# keyrings, SysV IPC, memfd, fallocate, file locks and leases, inotify/fanotify/dnotify, AIO,
# io_uring, userfaultfd, bpf, perf, file times (the bound device nodes are the host's), clearing
# the parent-death signal, socket(2) (socketpair stays), what reaches host-wide state: sync,
# syncfs, pipe sizes, socket cookies and buffer sizes, and the page cache's eviction and state
# (fadvise, readahead, cachestat, madvise's cold and page-out); rlimits cap CPU, memory, locked
# memory, file size, open files, threads, pending signals (POSIX timers too) and priorities; the
# environment is empty. Output comes back through pipes, read up to a byte cap and then slowly
# (a flood costs the trainer next to nothing): the program holds no host file. The trainer learns
# the host PID of the namespace's first process from bwrap (`--info-fd`) and kills it by a pidfd
# on every exit path: the PID namespace and everything in it go with it.
SANDBOX_UID = 65534  # "nobody", inside the call's own user namespace (a normal trainer)
CALL_UIDS = (1 << 30, (1 << 31) - (1 << 16))  # a root trainer's per-call host uids: no account
THREADS = 16  # the program's threads (RLIMIT_NPROC, counted for its uid in its namespace)
TMPFS_MB = 16  # each of WORK, /tmp and /dev/shm: the program's total writes are bounded
WORK = "/sandbox"  # its working folder, a tmpfs inside its namespaces
STDERR_KEPT = 2000  # stderr's last bytes kept (its last line is the error shown)
PAST_CAP_PAUSE = 0.05  # seconds between two reads of a stream past its cap
REPOSITORY = Path(__file__).resolve().parents[1]
# answer files that ship inside installed packages: present in the venv, empty in the sandbox
PACKAGE_ANSWERS = {"bfcl_eval": "data/possible_answer"}

SANDBOX_BOOT = r"""
import ctypes, os, resource, sys
memory_mb, cpu_s, file_mb, threads, uid, python = sys.argv[1:]
mb = 1 << 20
for limit, value in [(resource.RLIMIT_AS, int(memory_mb) * mb), (resource.RLIMIT_CPU, int(cpu_s)),
                     (resource.RLIMIT_FSIZE, int(file_mb) * mb), (resource.RLIMIT_NOFILE, 64),
                     (resource.RLIMIT_NPROC, int(threads)), (resource.RLIMIT_CORE, 0),
                     (resource.RLIMIT_MSGQUEUE, 0), (resource.RLIMIT_MEMLOCK, 0),
                     (resource.RLIMIT_RTPRIO, 0), (resource.RLIMIT_NICE, 0),
                     (resource.RLIMIT_SIGPENDING, 64)]:
    resource.setrlimit(limit, (value, value))
if uid != "-":  # a root trainer's call: its own host uid, no groups, no capabilities left
    os.setgroups([])
    os.setresgid(int(uid), int(uid), int(uid))
    os.setresuid(int(uid), int(uid), int(uid))
ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: cleared by a uid change, set again
threads = {k: "1" for k in ["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"]}
os.execve(python, [python, "-I", "-B", "main.py"], threads)
"""

# The seccomp filter: the audit architecture, the syscall numbers it denies outright, and the
# numbers of clone, clone3, socket, fcntl and prctl, whose arguments it reads.
SYSCALLS = {
    "x86_64": {
        "arch": 0xC000003E,
        "deny": {
            "fork": 57,
            "vfork": 58,
            "shmget": 29,
            "shmat": 30,
            "semget": 64,
            "msgget": 68,
            "flock": 73,
            "ptrace": 101,
            "utime": 132,
            "io_setup": 206,
            "io_submit": 209,
            "utimes": 235,
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            "inotify_init": 253,
            "inotify_add_watch": 254,
            "futimesat": 261,
            "utimensat": 280,
            "unshare": 272,
            "inotify_init1": 294,
            "fallocate": 285,
            "perf_event_open": 298,
            "fanotify_init": 300,
            "fanotify_mark": 301,
            "setns": 308,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            "kcmp": 312,
            "memfd_create": 319,
            "bpf": 321,
            "userfaultfd": 323,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "pidfd_getfd": 438,
            "process_madvise": 440,
            "socket": 41,
            "readahead": 187,
            "fadvise64": 221,
            "sync": 162,
            "syncfs": 306,
            "cachestat": 451,
        },
        "clone": 56,
        "clone3": 435,
        "fcntl": 72,
        "prctl": 157,
        "madvise": 28,
        "setsockopt": 54,
        "getsockopt": 55,
    },
    "aarch64": {
        "arch": 0xC00000B7,
        "deny": {
            "io_setup": 0,
            "io_submit": 2,
            "inotify_init1": 26,
            "inotify_add_watch": 27,
            "flock": 32,
            "fallocate": 47,
            "utimensat": 88,
            "unshare": 97,
            "ptrace": 117,
            "shmget": 194,
            "shmat": 196,
            "semget": 190,
            "msgget": 186,
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            "perf_event_open": 241,
            "fanotify_init": 262,
            "fanotify_mark": 263,
            "setns": 268,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            "kcmp": 272,
            "memfd_create": 279,
            "bpf": 280,
            "userfaultfd": 282,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "pidfd_getfd": 438,
            "process_madvise": 440,
            "socket": 198,
            "readahead": 213,
            "fadvise64": 223,
            "sync": 81,
            "syncfs": 267,
            "cachestat": 451,
        },
        "clone": 220,
        "clone3": 435,
        "fcntl": 25,
        "prctl": 167,
        "madvise": 233,
        "setsockopt": 208,
        "getsockopt": 209,
    },
}
CLONE_THREAD = 0x10000  # clone without it makes a process: denied; with it, a thread: allowed
# F_SETLK, F_SETLKW, F_OFD_SETLK, F_OFD_SETLKW, F_SETLEASE, F_NOTIFY (dnotify), F_SETPIPE_SZ (the
# trainer user's pipe-buffer pages are one quota, shared with its calls)
DENIED_FCNTL_COMMANDS = [6, 7, 37, 38, 1024, 1026, 1031]
# MADV_COLD, MADV_PAGEOUT: they evict pages of bound host files from the shared page cache
DENIED_MADVICE = [20, 21]
# SOL_SOCKET options of a socketpair: SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE (kernel
# memory past the defaults), SO_COOKIE, SO_NETNS_COOKIE (host-wide counters a call could leave a
# note in for the next)
SOL_SOCKET, DENIED_SOCKET_OPTIONS = 1, [7, 8, 32, 33, 57, 71]
PR_SET_PDEATHSIG, SIGKILL = 1, 9  # prctl may set the parent-death signal only to SIGKILL
EPERM, ENOSYS = 1, 38

# classic BPF, as seccomp(2) reads it: (code, jump if true, jump if false, k)
LOAD_WORD, JUMP_EQ, JUMP_GE, JUMP_SET, RETURN = 0x20, 0x15, 0x35, 0x45, 0x06
SECCOMP_ALLOW, SECCOMP_ERRNO, SECCOMP_KILL = 0x7FFF0000, 0x00050000, 0x80000000
# offsets in struct seccomp_data (the low word of each argument, little-endian)
NR, ARCH, ARG0, ARG1, ARG2 = 0, 4, 16, 24, 32


def seccomp_filter(machine):
    """The filter as bytes for bwrap's --seccomp: a list of instructions whose jump targets are
    labels, assembled into relative offsets."""
    table = SYSCALLS[machine]
    program = [
        (LOAD_WORD, None, None, ARCH),
        (JUMP_EQ, None, "kill", table["arch"]),
        (LOAD_WORD, None, None, NR),
    ]
    if machine == "x86_64":  # the x32 ABI's numbers
        program.append((JUMP_GE, "deny", None, 0x40000000))
    program += [(JUMP_EQ, "deny", None, number) for number in table["deny"].values()]
    program += [
        (JUMP_EQ, "clone", None, table["clone"]),
        (JUMP_EQ, "enosys", None, table["clone3"]),
        (JUMP_EQ, "fcntl", None, table["fcntl"]),
        (JUMP_EQ, "prctl", None, table["prctl"]),
        (JUMP_EQ, "madvise", None, table["madvise"]),
        (JUMP_EQ, "sockopt", None, table["setsockopt"]),
        (JUMP_EQ, "sockopt", None, table["getsockopt"]),
        (RETURN, None, None, SECCOMP_ALLOW),
        "clone",
        (LOAD_WORD, None, None, ARG0),
        (JUMP_SET, "allow", "deny", CLONE_THREAD),
        "fcntl",
        (LOAD_WORD, None, None, ARG1),
    ]
    program += [(JUMP_EQ, "deny", None, command) for command in DENIED_FCNTL_COMMANDS]
    program += [
        (RETURN, None, None, SECCOMP_ALLOW),
        "prctl",
        (LOAD_WORD, None, None, ARG0),
        (JUMP_EQ, None, "allow", PR_SET_PDEATHSIG),
        (LOAD_WORD, None, None, ARG1),
        (JUMP_EQ, "allow", "deny", SIGKILL),
        "madvise",
        (LOAD_WORD, None, None, ARG2),
    ]
    program += [(JUMP_EQ, "deny", None, advice) for advice in DENIED_MADVICE]
    program += [
        (RETURN, None, None, SECCOMP_ALLOW),
        "sockopt",
        (LOAD_WORD, None, None, ARG1),
        (JUMP_EQ, None, "allow", SOL_SOCKET),
        (LOAD_WORD, None, None, ARG2),
    ]
    program += [(JUMP_EQ, "deny", None, option) for option in DENIED_SOCKET_OPTIONS]
    program += [
        "allow",
        (RETURN, None, None, SECCOMP_ALLOW),
        "deny",
        (RETURN, None, None, SECCOMP_ERRNO | EPERM),
        "enosys",
        (RETURN, None, None, SECCOMP_ERRNO | ENOSYS),
        "kill",
        (RETURN, None, None, SECCOMP_KILL),
    ]
    labels, instructions = {}, []
    for item in program:
        if isinstance(item, str):
            labels[item] = len(instructions)
        else:
            instructions.append(item)
    assembled = b""
    for index, (code, if_true, if_false, k) in enumerate(instructions):
        jump_true = labels[if_true] - index - 1 if if_true else 0
        jump_false = labels[if_false] - index - 1 if if_false else 0
        assert 0 <= jump_true < 256 and 0 <= jump_false < 256, "a jump past classic BPF's reach"
        assembled += struct.pack("<HBBI", code, jump_true, jump_false, k)
    return assembled


def bound_prefixes():
    """The interpreter's folders, by their real paths: the venv and the Python it was made from."""
    return sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)} - {"/usr"})


def answer_folders():
    """Folders of gold answers shipped inside installed packages (found without importing them)."""
    folders = []
    for package, inside in PACKAGE_ANSWERS.items():
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.origin:
            folder = Path(spec.origin).resolve().parent / inside
            if folder.is_dir():
                folders.append(str(folder))
    return folders


def prefix_problem(prefixes, hidden):
    """Why binding `prefixes` would show the program what it must not see, or None: the repository
    (its .git, runs/ and data), any git repository, or a folder of the run's data."""
    for prefix in prefixes:
        if REPOSITORY == Path(prefix) or Path(prefix) in REPOSITORY.parents:
            return (
                f"the interpreter's folder {prefix} holds the repository "
                "(make the venv in a folder of its own, e.g. .venv)"
            )
        if (Path(prefix) / ".git").exists():
            return f"the interpreter's folder {prefix} is a git repository"
        for path in hidden:
            if str(Path(path).parent) == prefix:
                return f"the interpreter's folder {prefix} holds the run's data file {path}"
    return None


def interpreter_links(python, readable):
    """bwrap arguments that make `python` resolve inside as outside where its chain of symlinks
    leaves the bound folders (a venv made from /usr/bin/python3): each link, then the file."""
    arguments, path = [], python
    while os.path.islink(path):
        target = os.readlink(path)
        if not any(path.startswith(folder + "/") for folder in readable):
            arguments += ["--symlink", target, path]
        path = os.path.normpath(os.path.join(os.path.dirname(path), target))
    if not any(path.startswith(folder + "/") for folder in readable):
        arguments += ["--ro-bind", path, path]
    return arguments


def call_uid():
    """A host uid for one call of a root trainer, from CALL_UIDS: no account has it and no
    process runs as it (only an archive unpacked with its owners could give it a file)."""
    running = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError):
            uid_line = next(ln for ln in status.read_text().splitlines() if ln.startswith("Uid:"))
            running.update(int(uid) for uid in uid_line.split()[1:])
    draw = random.SystemRandom()  # not the trainer's seeded generator
    while True:
        uid = draw.randrange(*CALL_UIDS)
        if uid not in running:
            try:
                pwd.getpwuid(uid)
            except KeyError:
                return uid


def bwrap_command(python, prefixes, fds, memory_mb, timeout, hidden, uid):
    """The bwrap command line: the allow-listed root (see above), read-only but its tmpfs folders,
    then SANDBOX_BOOT's caps. `fds` are the program's, the filter's and bwrap's info pipe;
    `uid` is the root trainer's call uid, or None for a normal trainer."""
    code_fd, seccomp_fd, info_fd = fds
    libraries = [f"/usr/{name}" for name in ["lib", "lib32", "lib64", "libx32"]]
    root = ["--perms", "0755", "--dir", "/usr"]
    root += [
        arg
        for lib in libraries
        if os.path.isdir(lib) and not os.path.islink(lib)
        for arg in ["--ro-bind", lib, lib]
    ]
    for top in ["/lib", "/lib32", "/lib64", "/libx32"]:  # merged-/usr links, or the folders
        if os.path.islink(top):
            root += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            root += ["--ro-bind", top, top]
    parents = sorted({str(up) for path in prefixes for up in Path(path).parents} - {"/"})
    for parent in parents:  # traversable inside, whatever the host's modes
        root += ["--perms", "0755", "--dir", parent]
    for path in prefixes:
        root += ["--ro-bind", path, path]
    readable = [*libraries, *prefixes]
    root += interpreter_links(python, readable)
    for path in hidden:  # the run's data under an allowed folder reads as empty
        if any(path.startswith(p + "/") for p in readable) and os.path.isfile(path):
            root += ["--ro-bind", "/dev/null", path]
    for folder in answer_folders():  # and so do the packages' answer folders
        if any(folder.startswith(p + "/") for p in readable):
            root += ["--size", "4096", "--tmpfs", folder, "--remount-ro", folder]
    if uid is None:  # a normal trainer: the program is SANDBOX_UID in a user namespace of its own
        user = [
            "--unshare-user",
            "--uid",
            str(SANDBOX_UID),
            "--gid",
            str(SANDBOX_UID),
            "--disable-userns",
            "--cap-drop",
            "ALL",
            "--as-pid-1",
        ]
    else:  # root: bwrap binds as root, the boot keeps only what it needs to drop to `uid`
        # NOTE: bwrap's init stays PID 1 here. bwrap keeps no capability, so only a process of
        # the same uid (root) receives its parent-death signal; the init, root with no
        # capabilities, carries it and takes the namespace with it. The program can neither
        # signal nor trace it (another uid, and ptrace is filtered).
        user = ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    size = str(TMPFS_MB << 20)
    return [
        "bwrap",
        *user,
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--info-fd",
        str(info_fd),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--ro-bind",  # ptys come from a pool every container on the host shares
        "/dev/null",
        "/dev/pts/ptmx",
        "--ro-bind",
        "/dev/null",
        "/proc/keys",
        "--ro-bind",
        "/dev/null",
        "/proc/key-users",
        *(
            arg
            for folder in ["/dev/shm", "/tmp", WORK]  # writable inside, size-capped
            for arg in ["--perms", "1777", "--size", size, "--tmpfs", folder]
        ),
        *root,  # after the tmpfs folders, so a venv under /tmp is bound on top of its tmpfs
        "--file",
        str(code_fd),
        f"{WORK}/main.py",
        "--seccomp",
        str(seccomp_fd),
        "--remount-ro",
        "/dev",
        "--remount-ro",
        "/proc",
        "--remount-ro",
        "/",
        "--chdir",
        WORK,
        "--",
        python,
        "-I",
        "-c",
        SANDBOX_BOOT,
        str(memory_mb),
        str(int(timeout) + 1),
        "1",
        str(THREADS),
        "-" if uid is None else str(uid),
        python,
    ]


def isolation_problem():
    """None when each Python tool call is isolated here, else why not (one line). Only success is
    remembered: a failed check is made again at the next call."""
    if getattr(isolation_problem, "ok", False):
        return None
    if sys.platform != "linux" or platform.machine() not in SYSCALLS:
        return f"no seccomp filter for {sys.platform} on {platform.machine()}"
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    problem = prefix_problem(bound_prefixes(), [])
    if problem:
        return problem
    output, ok = run_program("print(1)", 30, 256, 100, [], isolate=True)
    if (output, ok) != ("1", True):
        fix = (
            "make the interpreter's files readable by other users, and run the trainer "
            "with CAP_SYS_ADMIN (not in an unprivileged container)"
            if os.geteuid() == 0
            else "allow unprivileged user namespaces (sysctl "
            "kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0)"
        )
        return (
            f"bubblewrap cannot isolate a call here ({output.splitlines()[-1][:200]}); "
            f"to fix: {fix}"
        )
    isolation_problem.ok = True
    return None


def python_tool(code, timeout=10.0, memory_mb=1024, max_output=2000, hidden_files=(), unsafe=False):
    """Run model-written code in an isolated process and return (output, ok); never raises.

    Output is stdout plus the last stderr line on failure, cut at `max_output` characters; a run
    past `timeout` seconds is killed with everything it started. `hidden_files` (the run's data)
    are absent, or read as empty where they lie under a folder the program may read. Without
    isolation the tool is disabled and says why, unless `unsafe` (the user's explicit opt-in) runs
    the code unisolated. A failure of the tool itself is an error observation for the agent, never
    an exception in the trainer.
    """
    try:
        hidden = [str(Path(f).resolve()) for f in hidden_files]
        if unsafe:
            return run_program(code, timeout, memory_mb, max_output, hidden, isolate=False)
        problem = isolation_problem() or prefix_problem(bound_prefixes(), hidden)
        if problem:
            return f"error: the Python tool is disabled: {problem}", False
        return run_program(code, timeout, memory_mb, max_output, hidden, isolate=True)
    except Exception as err:  # noqa: BLE001 - by contract: an observation, not a crash
        return f"error: the Python tool failed ({type(err).__name__})", False


def read_capped(process, deadline, max_bytes):
    """stdout's first `max_bytes` and stderr's last STDERR_KEPT bytes, read as they come until
    both close or the `deadline` (time.monotonic) passes. A stream past its cap is still read, so
    the program never blocks for good, but one pipeful per PAST_CAP_PAUSE seconds: the program
    waits on its full pipe, and a flood costs the trainer next to no CPU."""
    kept = {process.stdout: b"", process.stderr: b""}
    total = dict.fromkeys(kept, 0)
    cap = {process.stdout: max_bytes, process.stderr: STDERR_KEPT}
    with selectors.DefaultSelector() as selector:
        for pipe in kept:
            selector.register(pipe, selectors.EVENT_READ)
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=max(0.0, deadline - time.monotonic())):
                pipe = key.fileobj
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(pipe)
                    continue
                total[pipe] += len(chunk)
                if pipe is process.stdout:
                    kept[pipe] = (kept[pipe] + chunk)[:max_bytes]
                else:
                    kept[pipe] = (kept[pipe] + chunk)[-STDERR_KEPT:]
                if total[pipe] > cap[pipe]:
                    time.sleep(max(0.0, min(PAST_CAP_PAUSE, deadline - time.monotonic())))
        finished = not selector.get_map()
    return kept[process.stdout], kept[process.stderr], finished


def run_program(code, timeout, memory_mb, max_output, hidden, isolate):
    """One run: the program, its capped output, and its kill on every exit path (a timeout, an
    exception, Ctrl-C in the trainer)."""
    import resource

    # the venv's own interpreter, reached through the real path of its folder
    python = str(Path(sys.executable).parent.resolve() / Path(sys.executable).name)
    # only an unisolated run needs a host folder; an isolated one gets its code through a memfd
    workdir = (
        contextlib.nullcontext("/")
        if isolate
        else tempfile.TemporaryDirectory(prefix="agentflow_py_", ignore_cleanup_errors=True)
    )
    with workdir as tmp:
        fds, info = [], None
        if isolate:
            info, info_write = os.pipe()
            fds = [os.memfd_create("main.py"), os.memfd_create("seccomp"), info_write]
            os.write(fds[0], code.encode("utf-8", "replace"))
            os.write(fds[1], seccomp_filter(platform.machine()))
            for fd in fds[:2]:
                os.lseek(fd, 0, os.SEEK_SET)
            uid = call_uid() if os.geteuid() == 0 else None
            command = bwrap_command(python, bound_prefixes(), fds, memory_mb, timeout, hidden, uid)
            preexec = None
        else:
            Path(tmp, "main.py").write_text(code)
            command = [python, "-I", "-B", "main.py"]

            def preexec():
                for limit, value in [
                    (resource.RLIMIT_AS, memory_mb << 20),
                    (resource.RLIMIT_FSIZE, 1 << 20),
                    (resource.RLIMIT_CPU, int(timeout) + 1),
                ]:
                    resource.setrlimit(limit, (value, value))

        try:
            process = subprocess.Popen(
                command,
                cwd=tmp,
                env={},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                preexec_fn=preexec,
                start_new_session=True,
                pass_fds=fds,
            )
        finally:
            for fd in fds:
                os.close(fd)
        deadline = time.monotonic() + timeout
        pidfd = None
        try:
            if isolate:
                pidfd = namespace_pidfd(info, deadline, process.pid)
            stdout, stderr, finished = read_capped(process, deadline, max_output + 1)
            if finished:  # its pipes closed: it has the rest of its time to exit
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            finished = False
        finally:
            end_call(process, pidfd)
            if info is not None:
                os.close(info)
    if not finished:
        return f"error: timed out after {timeout:g} s", False
    text = stdout.decode("utf-8", "replace")
    errors = stderr.decode("utf-8", "replace").strip().splitlines()
    if process.returncode and errors:
        text += "\n" + errors[-1]
    text = text.strip() or (
        "(no output; print the result)"
        if process.returncode == 0
        else f"error: exit status {process.returncode}"
    )
    cut = " …[truncated]" if len(text) > max_output else ""
    return text[:max_output] + cut, process.returncode == 0


def namespace_pidfd(info, deadline, bwrap_pid):
    """A pidfd of the PID namespace's first process, from the host PID that bwrap writes to its
    info pipe once the namespace exists; None if it has ended: the process the pidfd holds must
    still be bwrap's child (bwrap is this process's unreaped child, so its PID is its own)."""
    data = b""
    while time.monotonic() < deadline:
        if not select.select([info], [], [], max(0.0, deadline - time.monotonic()))[0]:
            break
        chunk = os.read(info, 4096)
        if not chunk:
            break
        data += chunk
    try:
        pid = json.loads(data)["child-pid"]
        pidfd = os.pidfd_open(pid)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ValueError, KeyError, OSError):
        return None
    if int(stat.rsplit(")", 1)[1].split()[1]) != bwrap_pid:  # ended, and its PID taken since
        os.close(pidfd)
        return None
    return pidfd


def end_call(process, pidfd):
    """SIGKILL the program (its PID namespace and everything in it go too), whatever it did to its
    own signals, and bwrap's process group; wait until both are gone, reap the program where it
    was left to this process (a trainer that is PID 1 or a subreaper), close the pipes."""
    if pidfd is not None:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    if pidfd is not None:
        select.select([pidfd], [], [], 2.0)  # readable once the program has exited
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
        os.close(pidfd)
    for _ in range(200):  # an unisolated run's process group
        try:
            os.killpg(process.pid, 0)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.01)
    process.stdout.close()
    process.stderr.close()
