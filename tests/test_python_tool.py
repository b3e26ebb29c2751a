"""sandbox.python_tool: model-written code runs isolated at the OS level, or not at all. Each
hostile program below is checked from outside: no file appears anywhere we watch, no packet reaches
a loopback listener, no process is left, no secret or gold answer is printed, no file, key, IPC
object or counter passes from one call to the next, no host-wide pool or quota of the trainer is
taken, and the trainer is untouched. The same holds for a trainer run by a normal user. Where this
machine cannot isolate, the isolation tests do not run and the session's summary says so ("not
isolated here"); the fail-closed tests run everywhere."""

import ast
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import venv
from pathlib import Path

import pytest

from envs import sandbox

PROBLEM = sandbox.isolation_problem()
isolated = pytest.mark.skipif(PROBLEM is not None, reason=f"not isolated here: {PROBLEM}")

REPO = Path(__file__).resolve().parents[1]
SECRET = "s3cret-token-123"
GOLD = "gold-answer-9137"
SHM_KEY = 0x5EED51


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """What a program must not reach: a folder, a data file with a gold answer, a secret in the
    trainer's environment, UDP/TCP/IPv6 listeners on loopback and a unix socket."""
    base = tmp_path_factory.mktemp("outside")
    # world-writable: only isolation, not file permissions, can stop a write here
    os.chmod(base, 0o777)
    (base / "gold.jsonl").write_text(f'{{"question": "q", "answer": "{GOLD}"}}\n')
    os.chmod(base / "gold.jsonl", 0o644)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    udp6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    udp6.bind(("::1", 0))
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    unix.bind(str(base / "unix.sock"))
    os.chmod(base / "unix.sock", 0o777)
    for s in (udp, tcp, udp6, unix):
        s.setblocking(False)
    os.environ["AGENTFLOW_SECRET"] = SECRET
    # a key in the trainer's session keyring, and gold answers committed in a git repository
    libc = ctypes.CDLL(None)
    libc.syscall(248, b"user", b"agentflow", SECRET.encode(), len(SECRET), -3)  # add_key
    subprocess.run(["git", "init", "-q", str(base / "repo")], check=True)
    (base / "repo" / "gold.txt").write_text(GOLD)
    git = ["git", "-C", str(base / "repo"), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "commit", "-qm", "gold", "--allow-empty"], check=True)
    subprocess.run([*git, "add", "gold.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "gold"], check=True)
    yield {"dir": base, "udp": udp, "tcp": tcp, "udp6": udp6, "unix": unix, "pid": os.getpid()}
    del os.environ["AGENTFLOW_SECRET"]


def sandbox_processes():
    """Processes left by the tool: bwrap, or an interpreter running a program `main.py`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes() if proc.name.isdigit() else b""
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if command.startswith(b"bwrap\0") or b"\0-B\0main.py\0" in command:
            found.append(int(proc.name))
    return found


def parent(pid):
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return 0


def left_behind():
    """Sandbox processes that no Python process is running a call for: their first ancestor
    outside the sandbox is not an interpreter (a call of another test worker in flight is one)."""
    found = sandbox_processes()
    orphans = []
    for pid in found:
        owner = parent(pid)
        while owner in found:
            owner = parent(owner)
        try:
            command = Path(f"/proc/{owner}/cmdline").read_bytes() if owner > 1 else b""
        except (FileNotFoundError, ProcessLookupError):
            command = b""
        if b"python" not in command.split(b"\0")[0]:
            orphans.append(pid)
    return orphans


def descends_from(pid, ancestor):
    """Whether process `pid` has `ancestor` among its parents (by /proc/<pid>/stat)."""
    while pid > 1:
        pid = parent(pid)
        if pid == ancestor:
            return True
    return False


def hostile_programs(o):
    d, pid = o["dir"], o["pid"]
    udp, tcp, udp6 = (
        o["udp"].getsockname()[1],
        o["tcp"].getsockname()[1],
        o["udp6"].getsockname()[1],
    )
    return {
        "os.system": f"import os; os.system('touch {d}/a')",
        "subprocess": f"import subprocess; subprocess.run(['touch', '{d}/b'])",
        "fork": f"import os\nif os.fork() == 0: open('{d}/c', 'w')",
        "fork bomb": "import os\nwhile True: os.fork()",
        "multiprocessing spawn": f"import multiprocessing as m\nm.set_start_method('spawn')\n"
        f"p = m.Process(target=open, args=('{d}/d', 'w')); p.start(); p.join()",
        "pty spawn": "import pty; pty.spawn(['/bin/sh', '-c', 'touch /tmp/e'])",
        "ctypes system": f"import ctypes; ctypes.CDLL(None).system(b'touch {d}/f')",
        "exec a shell": f"import os; os.execv('/bin/sh', ['sh', '-c', 'touch {d}/g'])",
        "open for write": f"open('{d}/h', 'w').write('x')",
        "os.open with dir_fd": f"import os; fd = os.open('{d}', os.O_RDONLY)\n"
        "os.open('i', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
        "symlink out": f"import os; os.symlink('{d}', 'link'); open('link/j', 'w')",
        "write into the repository": f"open('{REPO}/README.md', 'a').write('pwned')",
        "write to host /dev/shm and /var/tmp": "open('/dev/shm/pwned_k', 'w'); "
        "open('/var/tmp/pwned_k', 'w')",
        "udp to loopback": f"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
        f".sendto(b'x', ('127.0.0.1', {udp}))",
        "tcp to loopback": "import socket; "
        f"socket.create_connection(('127.0.0.1', {tcp}), timeout=1).send(b'x')",
        "udp over ipv6": "import socket; socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)"
        f".sendto(b'x', ('::1', {udp6}))",
        "unix socket": "import socket; socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)"
        f".sendto(b'x', '{d}/unix.sock')",
        "raw packet socket": "import socket; socket.socket(socket.AF_PACKET, socket.SOCK_RAW)",
        "read the trainer's environment": f"print(open('/proc/{pid}/environ').read())",
        "read /proc of pid 1's parent": "import os; print(os.listdir('/proc')); "
        "print(open('/proc/1/environ').read())",
        "print own environment": "import os; print(dict(os.environ))",
        "read the gold answers": f"print(open('{d}/gold.jsonl').read())",
        "signal the trainer": f"import os, signal; os.kill({pid}, signal.SIGKILL)",
        "signal everyone": "import os, signal; os.kill(-1, signal.SIGKILL)",
        "become root": "import os; os.setuid(0)",
        "huge output": "print('x' * 10**8)",
        "huge file": "open('big', 'wb').write(b'x' * 10**9)",
        "huge memory": "a = bytearray(8 * 10**9)",
        "endless loop": "while True: pass",
        "setsid, then outlive the timeout": f"import os, time\nos.setsid()\ntime.sleep(4)\n"
        f"open('{d}/late', 'w')",
        "read the trainer's session keyring": "import ctypes; c = ctypes.CDLL(None)\n"
        "k = c.syscall(250, 10, -3, b'user', b'agentflow', 0)\n"
        "b = ctypes.create_string_buffer(99); c.syscall(250, 11, k, b, 99); print(b.value)",
        "git show the committed gold": f"import os; os.execv('/usr/bin/git', "
        f"['git', '-C', '{d}/repo', 'show', 'HEAD:gold.txt'])",
        "write to /run/lock": "open('/run/lock/pwned_l', 'w')",
        "SysV shared memory that outlives the run": "import ctypes\n"
        f"print(ctypes.CDLL(None).shmget({SHM_KEY}, 1 << 20, 0o1666))",
        "fill the disk": "\n".join(
            ["for i in range(64):", "    open(f'fill{i}', 'wb').write(b'x' * (1 << 20))"]
        ),
        "a setuid helper": "import os; os.execv('/usr/bin/passwd', ['passwd', '-S', 'root'])",
        # past the caps: host disk through an output fd, memory outside RLIMIT_AS, inodes
        "allocate host disk through stdout": "import ctypes\n"
        "print(ctypes.CDLL(None).fallocate(1, 1, 0, 48 << 20))",
        "allocate through a file of its own": "import ctypes, os\nfd = os.open('f', os.O_RDWR | "
        "os.O_CREAT)\nprint(ctypes.CDLL(None).fallocate(fd, 1, 0, 48 << 20))",
        "detached shared memory past the limit": "import ctypes\nc = ctypes.CDLL(None)\n"
        f"i = c.shmget({SHM_KEY}, 120 << 20, 0o1666)\nc.shmat(i, None, 0)\nprint(i)",
        "memory through a memfd": "import os\nfd = os.memfd_create('m')\n"
        "os.write(fd, b'x' * (64 << 20))",
        "tmpfs inode flood": "import os\nfor i in range(60000): open(f'n{i}', 'w').close()",
        "a nested user namespace": "import ctypes\nprint(ctypes.CDLL(None).unshare(0x10000000))",
        "io_uring": "import ctypes\nprint(ctypes.CDLL(None).syscall(425, 8, bytes(120)))",
        "userfaultfd": "import ctypes\nprint(ctypes.CDLL(None).syscall(323, 0))",
        "a vsock socket": "import socket\nsocket.socket(40, socket.SOCK_STREAM)",
        "the persistent keyring": "import ctypes\n"
        "print(ctypes.CDLL(None).syscall(250, 22, -1, -4))",
    }


PROBES = r"""
import errno, json, os
def attempt(action):
    try:
        action()
        return "done"
    except OSError as err:
        return errno.errorcode[err.errno]
def rewrite(path):  # writes back what is there: harmless if it were allowed
    value = open(path).read()
    open(path, "w").write(value)
print(json.dumps({
    "sysctl": attempt(lambda: rewrite("/proc/sys/kernel/core_pattern")),
    "chmod a device": attempt(lambda: os.chmod("/dev/null", 0o666)),
    "touch a device": attempt(lambda: os.utime("/dev/null")),
    "root-only /proc": attempt(lambda: open("/proc/kpageflags", "rb").read(8)),
    "/proc/keys": attempt(lambda: open("/proc/keys").read()),
    "write /": attempt(lambda: open("/x", "w")),
    "write /dev": attempt(lambda: open("/dev/x", "w")),
    "write /usr/lib": attempt(lambda: open("/usr/lib/x", "w")),
    "write /tmp": attempt(lambda: open("/tmp/x", "w")),
    "write /dev/shm": attempt(lambda: open("/dev/shm/x", "w")),
    "write the working folder": attempt(lambda: open("x", "w")),
}))
"""
THREADS = (
    "import threading, time\nmade = 0\ntry:\n    for _ in range(3000):\n"
    "        threading.Thread(target=time.sleep, args=(2,), daemon=True).start()\n"
    "        made += 1\nexcept RuntimeError:\n    pass\nprint(made)"
)
PROBES_EXPECTED = {
    "sysctl": ("EACCES", "EROFS"),
    "chmod a device": ("EPERM",),
    "touch a device": ("EPERM",),
    "root-only /proc": ("EACCES",),
    "/proc/keys": ("EACCES",),
    "write /": ("EROFS",),
    "write /dev": ("EROFS",),
    "write /usr/lib": ("EROFS",),
    "write /tmp": ("done",),
    "write /dev/shm": ("done",),
    "write the working folder": ("done",),
}


def untouched(o, readme_before):
    left = [p.name for p in o["dir"].iterdir() if p.name not in ("gold.jsonl", "unix.sock", "repo")]
    assert left == [], left
    assert (REPO / "README.md").read_bytes() == readme_before
    assert not Path("/dev/shm/pwned_k").exists() and not Path("/var/tmp/pwned_k").exists()
    assert not Path("/tmp/e").exists()
    for sock in (o["udp"], o["udp6"], o["unix"]):
        with pytest.raises(BlockingIOError):
            sock.recv(1)
    with pytest.raises(BlockingIOError):
        o["tcp"].accept()
    assert left_behind() == []  # no process of the sandbox is left
    assert not Path("/run/lock/pwned_l").exists()
    assert str(SHM_KEY) not in Path("/proc/sysvipc/shm").read_text()  # its IPC namespace is gone


@isolated
def test_hostile_programs_have_no_effect_outside(outside):
    readme_before = (REPO / "README.md").read_bytes()
    programs = hostile_programs(outside)
    assert len(programs) >= 20
    for name, code in programs.items():
        start = time.time()
        output, _ = sandbox.python_tool(
            code, timeout=3, hidden_files=[outside["dir"] / "gold.jsonl"]
        )
        assert time.time() - start < 6, name
        assert SECRET not in output and GOLD not in output, name
        assert len(output) < 2100, name
    time.sleep(0.5)
    untouched(outside, readme_before)


def test_the_check_can_fail(outside):
    """The same checks see a write when the code runs as the trainer itself (no sandbox)."""
    readme_before = (REPO / "README.md").read_bytes()
    open(outside["dir"] / "h", "w").close()
    with pytest.raises(AssertionError):
        untouched(outside, readme_before)
    os.remove(outside["dir"] / "h")


@isolated
def test_ordinary_numpy_and_sympy_code_gets_the_right_answer(outside):
    output, ok = sandbox.python_tool(
        "import numpy as np, sympy as sp\n"
        "print(int(np.arange(10).sum()), sp.factorint(360), sp.solve('x**2 - 4'))"
    )
    assert ok and output == "45 {2: 3, 3: 2, 5: 1} [-2, 2]"
    output, ok = sandbox.python_tool(
        "open('notes.txt', 'w').write('hi'); print(open('notes.txt').read())"
    )
    assert ok and output == "hi"


@isolated
def test_works_from_a_symlinked_virtual_environment(tmp_path):
    """A venv whose real folder lies under /tmp (a tmpfs inside the sandbox), reached through a
    symlink under runs/, still runs the tool, in that venv."""
    venv.create(tmp_path / "venv", with_pip=False)
    link = REPO / "runs" / f"venv-link-{os.getpid()}"
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(tmp_path / "venv", target_is_directory=True)
    call = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); from envs import sandbox; "
        "print(sandbox.python_tool('import sys; print(sys.prefix)')[0])"
    )
    try:
        done = subprocess.run(
            [str(link / "bin" / "python"), "-c", call],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        link.unlink()
        shutil.rmtree(tmp_path / "venv")
    # the program ran in that venv (under /tmp, which the sandbox otherwise replaces by a tmpfs)
    ran_in = done.stdout.strip()
    assert ran_in == str((tmp_path / "venv").resolve()), ran_in + done.stderr[-500:]


@isolated
@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.makedirs('/'.join(['d'] * 1200))",  # a cleanup that used to recurse too deep
        "import os, time\nos.setsid()\nwhile True: open('x', 'w').write('y')",  # keeps writing
    ],
)
def test_no_program_makes_the_tool_raise(code):
    output, ok = sandbox.python_tool(code, timeout=2)
    assert isinstance(output, str) and ok is False


@isolated
def test_every_denied_system_call_fails_inside():
    """Each call the seccomp filter denies returns an error inside the sandbox; threads still
    work (numpy and sympy need them), children do not."""
    raising = {  # Python raises PermissionError (or OSError) for these
        "fork": "import os\nos.fork()",
        "flock": "import fcntl\nfcntl.flock(open('/usr/lib/os-release'), fcntl.LOCK_EX)",
        "fcntl lock": "import fcntl\nfcntl.lockf(open('/tmp/x', 'w'), fcntl.LOCK_EX)",
        "memfd_create": "import os\nos.memfd_create('m')",
        "fallocate": "import os\nos.posix_fallocate(os.open('f', os.O_RDWR | os.O_CREAT), 0, 4096)",
        "AF_ALG socket": "import socket\nsocket.socket(38, socket.SOCK_SEQPACKET)",
        "a lease on a host file": "import fcntl\n"
        "fcntl.fcntl(open('/usr/lib/os-release'), 1024, fcntl.F_RDLCK)",  # F_SETLEASE
        "dnotify on a host folder": "import fcntl, os\n"
        "fcntl.fcntl(os.open('/usr/lib', os.O_RDONLY), 1026, 0x80000001)",  # F_NOTIFY
        "a unix socket": "import socket\nsocket.socket(socket.AF_UNIX)",
        "host uevents over netlink": "import socket\n"
        "socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 15).bind((0, 1))",
        "a socket cookie": "import socket\nsocket.socketpair()[0].getsockopt(1, 57, 8)",
        "a socket's buffer size": "import socket\nsocket.socketpair()[0].setsockopt(1, 7, 1 << 24)",
        "a pipe's size": "import fcntl, os\nfcntl.fcntl(os.pipe()[1], 1031, 1 << 20)",
        "fadvise": "import os\nos.posix_fadvise(os.open('/usr/lib', os.O_RDONLY), 0, 0, 4)",
        "page out a mapping": "import mmap\nmmap.mmap(-1, 4096).madvise(21)",  # MADV_PAGEOUT
    }
    for name, code in raising.items():
        output, ok = sandbox.python_tool(code, timeout=5)
        assert not ok and "Error" in output, (name, output)
    returning = {  # the raw call returns -1
        "keyctl (the user keyring)": "syscall(250, 0, -4, 0)",
        "add_key": "syscall(248, b'user', b'k', b'v', 1, -4)",
        "shmget": "shmget(0, 4096, 0o1600)",
        "unshare a user namespace": "unshare(0x10000000)",
        "io_uring_setup": "syscall(425, 8, bytes(120))",
        "bpf": "syscall(321, 0, bytes(128), 128)",
        "perf_event_open": "syscall(298, bytes(128), 0, -1, -1, 0)",
        "ptrace itself": "ptrace(0, 0, 0, 0)",  # PTRACE_TRACEME
        "ptrace PID 1": "ptrace(16, 1, 0, 0)",  # PTRACE_ATTACH
        "read another process's memory": "syscall(310, 1, 0, 0, 0, 0, 0)",
        "inotify on host files": "inotify_init1(0)",
        "fanotify": "syscall(300, 0, 0)",
        "AIO contexts (a host-wide count)": "syscall(206, 1, bytes(8))",
        "a new mount namespace": "unshare(0x20000)",
        "join a namespace": "syscall(308, 0, 0)",
        "clear the parent-death signal": "prctl(1, 0)",
        "readahead of a host file": "syscall(187, 0, 0, 4096)",
        "the page cache's state (cachestat)": "syscall(451, 0, bytes(16), bytes(48), 0)",
        "syncfs": "syncfs(0)",
    }
    for name, call in returning.items():
        output, ok = sandbox.python_tool(f"import ctypes\nprint(ctypes.CDLL(None).{call})")
        assert (output, ok) == ("-1", True), (name, output)
    output, ok = sandbox.python_tool(
        "import socket, threading\nt = threading.Thread(target=print, args=('thread',))\n"
        "t.start(); t.join()\na, b = socket.socketpair(); a.send(b'pair'); print(b.recv(4))"
    )
    assert (output, ok) == ("thread\nb'pair'", True)


@isolated
def test_nothing_passes_from_one_call_to_the_next():
    """A note left in a keyring or a file by one call is gone at the next: episodes are
    independent."""
    sandbox.python_tool(
        "import ctypes\nc = ctypes.CDLL(None)\n"
        "for ring in (-4, -5): c.syscall(248, b'user', b'note', b'left-by-1', 9, ring)\n"
        "open('/tmp/note', 'w').write('left-by-1'); open('note', 'w').write('left-by-1')"
    )
    output, _ = sandbox.python_tool(
        "import ctypes, os\nc = ctypes.CDLL(None)\nfor ring in (-4, -5):\n"
        "    k = c.syscall(250, 10, ring, b'user', b'note', 0)\n"
        "    b = ctypes.create_string_buffer(99); c.syscall(250, 11, k, b, 99); print(b.value)\n"
        "print([os.path.exists(p) for p in ('/tmp/note', 'note')])"
    )
    assert "left-by-1" not in output and "[False, False]" in output, output


@isolated
def test_no_note_passes_through_a_socket_cookie():
    """A host-wide counter (the socket cookie) read by one call after another advanced it would
    carry a note: a call can read no cookie, and so can the next."""
    write = "import socket\nfor _ in range(300):\n    socket.socketpair()[0].getsockopt(1, 57, 8)"
    read = "import socket\nprint(socket.socketpair()[0].getsockopt(1, 57, 8))"
    sandbox.python_tool(write)
    output, ok = sandbox.python_tool(read)
    assert not ok and "PermissionError" in output, output


def resident_pages(path):
    """How many of the file's pages are in the host's page cache (mincore of a mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    size = path.stat().st_size
    pages = ctypes.create_string_buffer((size + 4095) // 4096)
    with open(path, "rb") as file:
        address = libc.mmap(None, size, 1, 1, file.fileno(), 0)  # PROT_READ, MAP_SHARED
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), pages) == 0
        libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
    return sum(byte & 1 for byte in pages.raw)


@isolated
def test_no_note_passes_through_the_page_cache_of_a_bound_file():
    """Pages of a bound interpreter file dropped by one call would be a note the next reads by
    timing: after a call that asks the kernel to drop them, they are still cached (from outside).
    A test module of sympy: a file of the bound venv that nothing imports."""
    import sympy

    path = max(Path(sympy.__file__).parent.rglob("test_*.py"), key=lambda p: p.stat().st_size)
    path.read_bytes()  # cached
    cached = resident_pages(path)
    drop = (
        f"import mmap, os\nfd = os.open({str(path)!r}, os.O_RDONLY)\n"
        "for evict in [lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED),\n"
        "              lambda: mmap.mmap(fd, 0, prot=mmap.PROT_READ).madvise(21)]:\n"
        "    try:\n        evict()\n    except OSError as err:\n        print(err.errno)"
    )
    output, ok = sandbox.python_tool(drop)
    assert ok and output == "1\n1", output  # EPERM, both
    assert resident_pages(path) == cached > 0


def dirty_pages(path):
    """The file's dirty pages in the host's page cache (cachestat(2)), or None before Linux 6.5."""
    libc = ctypes.CDLL(None, use_errno=True)
    stats = ctypes.create_string_buffer(48)  # cache, dirty, writeback, evicted, recently evicted
    with open(path, "rb") as file:
        if libc.syscall(451, file.fileno(), bytes(16), stats, 0):  # the whole file
            return None
    return int.from_bytes(stats.raw[8:16], "little")


@isolated
def test_sync_inside_leaves_a_dirty_file_of_ours_dirty(tmp_path):
    """sync() and syncfs() would write back every process's dirty data on the host: a file the
    trainer just wrote keeps its dirty pages through a call that syncs."""
    ours = tmp_path / "dirty"
    ours.write_bytes(os.urandom(8 << 20))
    before = dirty_pages(ours)
    if not before:
        pytest.skip("no dirty page to watch here (cachestat needs Linux 6.5, a disk-backed /tmp)")
    output, ok = sandbox.python_tool(
        "import ctypes, os\nos.sync()\nprint(ctypes.CDLL(None).syncfs(os.open('/usr', 0)))"
    )
    assert (output, ok) == ("-1", True)
    assert dirty_pages(ours) > before // 2  # the kernel's own writeback waits 30 s


def host_pools():
    """(ptys taken, TCP pages allocated): counters every process on the host shares."""
    pty = int(Path("/proc/sys/kernel/pty/nr").read_text())
    tcp = next(ln for ln in Path("/proc/net/sockstat").read_text().splitlines() if "TCP:" in ln)
    return pty, int(tcp.split()[-1])


@isolated
def test_a_call_takes_no_pty_and_no_host_tcp_memory():
    """Ptys and the TCP stack's memory are host-wide pools: during a call that asks for 16 ptys
    and 16 loopback TCP pairs holding 2 MiB each, the host's counters barely move."""
    program = (
        "import os, socket, time\nptys, pairs = [], []\ntry:\n"
        "    for _ in range(16): ptys.append(os.openpty())\nexcept OSError:\n    pass\ntry:\n"
        "    for _ in range(16):\n        server = socket.create_server(('127.0.0.1', 0))\n"
        "        client = socket.create_connection(server.getsockname())\n"
        "        client.setblocking(False)\n        client.send(b'x' * (2 << 20))\n"
        "        pairs.append((server, client, server.accept()))\nexcept OSError:\n    pass\n"
        "print(len(ptys), len(pairs), flush=True)\ntime.sleep(2)"
    )
    before = host_pools()
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(result=sandbox.python_tool(program, 20)))
    thread.start()
    most = before
    while thread.is_alive():
        most = tuple(map(max, most, host_pools()))
        time.sleep(0.05)
    thread.join()
    assert seen["result"] == ("0 0", True), seen
    assert most[0] - before[0] < 8 and most[1] - before[1] < 1024, (before, most)  # 4 MiB


QUOTAS = r"""
import ctypes, fcntl, json, os, resource, threading, time
libc = ctypes.CDLL(None, use_errno=True)
# a small pending-signal quota, so that calls could use it up in a moment
resource.setrlimit(resource.RLIMIT_SIGPENDING, (2000, 2000))
HOG = '''
import ctypes, fcntl, os, time
libc, timers = ctypes.CDLL(None), 0
while timers < 2000 and libc.timer_create(1, None, ctypes.byref(ctypes.c_void_p())) == 0:
    timers += 1
for _ in range(28):
    try:
        fcntl.fcntl(os.pipe()[1], 1031, 1 << 20)  # F_SETPIPE_SZ, 1 MiB
    except OSError:
        pass
print(timers, flush=True)
time.sleep(2)
'''
def trainer_can():
    timer = ctypes.c_void_p()
    if libc.timer_create(1, None, ctypes.byref(timer)):
        return "timer_create " + os.strerror(ctypes.get_errno())
    libc.timer_delete(timer)
    read, write = os.pipe()
    try:
        fcntl.fcntl(write, 1031, 1 << 20)
    except OSError as err:
        return "F_SETPIPE_SZ " + err.strerror
    finally:
        os.close(read)
        os.close(write)
    return None
results = []
calls = [threading.Thread(target=lambda: results.append(sandbox.python_tool(HOG, 30)))
         for _ in range(3)]
for call in calls:
    call.start()
failures = []
while any(call.is_alive() for call in calls):
    failures.append(trainer_can())
    time.sleep(0.05)
print(json.dumps({"calls": results, "trainer": sorted({f for f in failures if f})}))
"""


@isolated
def test_the_trainers_timers_and_pipes_work_during_calls():
    """Three calls at once, each making POSIX timers and 1 MiB pipes until refused: a call makes
    at most 64 timers (each is unreclaimable kernel memory) and the trainer's own timer_create
    and F_SETPIPE_SZ keep working meanwhile (for a normal user they share its quotas; the
    normal-user test runs this too)."""
    quotas_hold(run_as(None, QUOTAS))


def quotas_hold(output):
    result = json.loads(output)
    assert result["trainer"] == [], result
    assert [ok for _, ok in result["calls"]] == [True] * 3, result
    assert all(int(timers) <= 64 for timers, _ in result["calls"]), result


@isolated
def test_a_flooding_call_costs_the_trainer_little_cpu():
    """A program that writes as fast as it can to stdout and stderr for its 3 s: the trainer's
    thread running the call spends under 0.2 s of CPU on it."""
    start = time.thread_time()
    output, ok = sandbox.python_tool(
        "import os\nwhile True:\n    os.write(1, b'x' * 65536)\n    os.write(2, b'y' * 65536)",
        timeout=3,
    )
    assert output == "error: timed out after 3 s" and not ok
    assert time.thread_time() - start < 0.2


@isolated
def test_three_concurrent_calls_all_succeed():
    """Calls in flight at once do not limit each other (no per-uid process count is shared)."""
    results = [None] * 3

    def call(k):
        results[k] = sandbox.python_tool(f"import time\ntime.sleep(1.5)\nprint({k})", timeout=20)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [("0", True), ("1", True), ("2", True)]


def run_as(uid, code, python=sys.executable, timeout=120, package=REPO):
    """Run `code` in a fresh interpreter as user `uid`, with `envs.sandbox` imported from the
    folder `package`."""
    call = f"import sys; sys.path.insert(0, {str(package)!r}); from envs import sandbox\n{code}"
    command = [python, "-c", call]
    if uid is not None:
        command = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def a_normal_user_can_be_made():
    """Why uid 1000's trainer cannot be made here (root, setpriv, a /usr/bin/python3 of this
    interpreter's version to carry numpy, user namespaces for that user), or None."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("unshare") is None:
        return "needs root, setpriv and unshare to become a normal user"
    system = Path("/usr/bin/python3")
    version = system.exists() and subprocess.run(
        [system, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True
    )
    if not version or version.stdout.strip() != str(sys.version_info[:2]):
        return "needs a /usr/bin/python3 of this interpreter's version (to carry its numpy)"
    userns = subprocess.run(
        ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "unshare", "--user", "true"],
        capture_output=True,
    )
    if userns.returncode:
        return "the kernel gives uid 1000 no user namespace (the tool fails closed for it)"
    return None


@isolated
def test_a_normal_user_gets_the_same_isolation():
    """A trainer run by uid 1000 (from a venv of its own holding numpy and sympy): ordinary code
    works and runs isolated; the user's own private file, its folder and the network are out of
    reach; the host-state probes, the thread cap and the trainer's quotas hold as for root."""
    import tempfile

    why_not = a_normal_user_can_be_made()
    if why_not:
        pytest.skip(why_not)

    import numpy
    import sympy

    tmp_path = Path(tempfile.mkdtemp(prefix="normal-user-"))  # pytest's own folder is root's
    try:
        normal_user_run(tmp_path, numpy, sympy)
    finally:
        shutil.rmtree(tmp_path)


def normal_user_run(tmp_path, numpy, sympy):
    # the tool as that user gets it: a copy in a folder it can read (the checkout may not be)
    (tmp_path / "package" / "envs").mkdir(parents=True)
    for name in ("__init__.py", "sandbox.py"):
        shutil.copy(REPO / "envs" / name, tmp_path / "package" / "envs" / name)
    home = tmp_path / "home"
    home.mkdir()
    (home / "id_ed25519").write_text(SECRET)
    env = home / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(env)], check=True)
    site = next(env.glob("lib/python3*/site-packages"))
    for module in (numpy, sympy, __import__("mpmath")):
        shutil.copytree(Path(module.__file__).parent, site / module.__name__)
    if Path(numpy.__file__).parent.with_name("numpy.libs").exists():
        shutil.copytree(Path(numpy.__file__).parent.with_name("numpy.libs"), site / "numpy.libs")
    subprocess.run(["chown", "-R", "1000:1000", str(tmp_path)], check=True)
    os.chmod(home / "id_ed25519", 0o600)
    os.chmod(tmp_path, 0o755)
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    programs = [
        "import numpy as np, sympy as sp, os\n"
        "print(int(np.arange(10).sum()), sp.factorint(360), os.getuid())",
        f"print(open({str(home / 'id_ed25519')!r}).read())",
        f"open({str(home / 'pwned')!r}, 'w')",
        "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
        f".sendto(b'x', ('127.0.0.1', {port}))",
        "import os\nos.fork()",
        PROBES,
        THREADS,
    ]
    code = (
        f"print(sandbox.isolation_problem())\nfor p in {programs!r}:\n"
        "    print(repr(sandbox.python_tool(p, timeout=20)))"
    )
    lines = run_as(
        1000, code, python=str(env / "bin" / "python"), package=tmp_path / "package"
    ).splitlines()
    assert lines[0] == "None", lines
    assert lines[1] == repr(("45 {2: 3, 3: 2, 5: 1} 65534", True)), lines
    assert all(SECRET not in line for line in lines) and lines[2].endswith("False)"), lines
    assert lines[5].endswith("False)"), lines  # no children
    probes = json.loads(ast.literal_eval(lines[6])[0])
    assert {k: v for k, v in probes.items() if v not in PROBES_EXPECTED[k]} == {}, probes
    threads, ok = ast.literal_eval(lines[7])
    assert ok and 0 < int(threads) < sandbox.THREADS, threads
    assert not (home / "pwned").exists()
    with pytest.raises(BlockingIOError):
        listener.recv(1)
    quotas_hold(
        run_as(1000, QUOTAS, python=str(env / "bin" / "python"), package=tmp_path / "package")
    )


@isolated
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to start processes of uid 65534",
)
def test_processes_of_the_sandbox_uid_elsewhere_change_nothing(tmp_path):
    """Three processes of uid 65534 elsewhere on the host (another trainer's calls, a daemon):
    a fresh trainer's check still passes and its calls are still isolated."""
    secret = tmp_path / "root-only"
    secret.write_text(SECRET)
    os.chmod(secret, 0o600)
    sleepers = [
        subprocess.Popen(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "60"]
        )
        for _ in range(3)
    ]
    try:
        out = run_as(
            None,
            "sandbox.isolation_problem.__dict__.clear()\n"
            "print(sandbox.isolation_problem())\n"
            f"print(sandbox.python_tool({f'print(open({str(secret)!r}).read())'!r}))",
        )
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
    assert out.splitlines()[0] == "None" and SECRET not in out, out


@isolated
def test_ctrl_c_in_the_trainer_leaves_no_process_behind():
    """SIGINT to a trainer in the middle of a call: the trainer stops and the program with it."""
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                # Ctrl-C raises KeyboardInterrupt, as in a trainer started from a terminal (a
                # suite started in the background, `make test &`, hands its children SIGINT ignored)
                "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                f"sys.path.insert(0, {str(REPO)!r}); from envs import sandbox\n"
                "sandbox.python_tool('import time\\ntime.sleep(60)', timeout=60)"
            ),
        ],
        # not this worker's own stderr: a pipe nobody drains fills up, and the trainer's
        # KeyboardInterrupt traceback would then block its exit
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 30
    started = []  # the trainer's own sandbox processes (other tests may run calls meanwhile)
    while time.time() < deadline and len(started) < 2:  # bwrap and the program under it
        time.sleep(0.1)
        started = [pid for pid in sandbox_processes() if descends_from(pid, trainer.pid)]
    assert started, "the call never started"
    trainer.send_signal(signal.SIGINT)
    trainer.wait(timeout=30)
    deadline = time.time() + 10  # the killed sandbox's teardown, slower on a busy machine
    while time.time() < deadline and set(started) & set(sandbox_processes()):
        time.sleep(0.1)
    assert not set(started) & set(sandbox_processes())


def test_without_bubblewrap_the_tool_refuses(tmp_path, monkeypatch):
    """Fail closed: with no bwrap on PATH the tool runs nothing, says why, and a marker program
    writes nothing; the explicit opt-in runs it unisolated."""
    marker = tmp_path / "marker"
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sandbox.isolation_problem, "ok", False, raising=False)
    problem = sandbox.isolation_problem()
    assert problem == "bubblewrap (bwrap) is not installed"
    output, ok = sandbox.python_tool(f"open({str(marker)!r}, 'w').write('ran')")
    assert not ok and output == f"error: the Python tool is disabled: {problem}"
    assert not marker.exists()
    output, ok = sandbox.python_tool(f"open({str(marker)!r}, 'w').write('ran')", unsafe=True)
    assert ok and marker.read_text() == "ran"


def test_an_interpreter_folder_holding_the_repository_or_a_git_repository_is_refused(tmp_path):
    """A venv made at the repository's root (or any git repository) would bind the repository,
    its .git and runs/ into the sandbox: the tool is disabled instead."""
    assert "holds the repository" in sandbox.prefix_problem([str(sandbox.REPOSITORY)], [])
    assert "holds the repository" in sandbox.prefix_problem(["/"], [])
    (tmp_path / ".git").mkdir()
    assert "git repository" in sandbox.prefix_problem([str(tmp_path)], [])
    assert "data file" in sandbox.prefix_problem(
        [str(tmp_path / "v")], [str(tmp_path / "v" / "gold.jsonl")]
    )
    assert sandbox.prefix_problem([str(tmp_path / "v")], []) is None


@isolated
def test_a_venv_at_a_repository_root_refuses_and_runs_nothing(tmp_path):
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    venv.create(repo, with_pip=False)
    marker = tmp_path / "marker"
    program = f"open({str(marker)!r}, 'w')"
    call = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); from envs import sandbox; "
        f"print(sandbox.python_tool({program!r}))"
    )
    done = subprocess.run(
        [str(repo / "bin" / "python"), "-c", call], capture_output=True, text=True, timeout=60
    )
    assert "disabled" in done.stdout and "git repository" in done.stdout, done.stdout + done.stderr
    assert not marker.exists()


@isolated
def test_answer_files_shipped_in_packages_read_as_empty():
    for folder in sandbox.answer_folders():
        assert os.listdir(folder)
        output, ok = sandbox.python_tool(f"import os; print(os.listdir({folder!r}))")
        assert (output, ok) == ("[]", True)


def program_pid(started_after, ancestor):
    """The host PID of this process's sandboxed program `main.py` that started after the PIDs
    `started_after` (other test workers' calls are not its descendants)."""
    deadline = time.time() + 20
    while time.time() < deadline:
        for pid in set(sandbox_processes()) - set(started_after):
            with contextlib.suppress(OSError):  # the boot has become the program: `-B main.py`
                program = b"\0-B\0main.py\0" in Path(f"/proc/{pid}/cmdline").read_bytes()
                if program and descends_from(pid, ancestor):
                    return pid
        time.sleep(0.05)
    raise AssertionError("the program never started")


def status_uids(pid):
    line = next(
        ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("Uid:")
    )
    return [int(uid) for uid in line.split()[1:]]


def watched_call(code, timeout, look=lambda pid: pid):
    """python_tool(code) in a thread while this process finds its program from outside:
    (the call's result, look(the program's host PID) read while it runs, the sandbox processes
    there were before)."""
    before = set(sandbox_processes())
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(result=sandbox.python_tool(code, timeout)))
    thread.start()
    found = look(program_pid(before, os.getpid()))
    thread.join()
    return seen["result"], found, before


@isolated
def test_the_program_is_a_host_uid_that_owns_nothing_and_changes_no_host_state():
    """Judged from outside: the program's host uid is never 0 (a root trainer's call gets a uid
    of CALL_UIDS with no account; a normal trainer's stays its own); host sysctls, device nodes,
    root-only /proc files and the keys are out of reach; only its own folders are writable."""
    import pwd

    core_pattern = Path("/proc/sys/kernel/core_pattern").read_text()
    null = os.stat("/dev/null")
    slow_probes = "import time\ntime.sleep(3)\n" + PROBES
    (output, ok), uids, _ = watched_call(slow_probes, 20, status_uids)
    assert ok, output
    if os.geteuid() == 0:
        assert all(sandbox.CALL_UIDS[0] <= uid < sandbox.CALL_UIDS[1] for uid in uids), uids
        with pytest.raises(KeyError):
            pwd.getpwuid(uids[0])
    else:
        assert uids == [os.getuid()] * 4
    probes = json.loads(output)
    assert {k: v for k, v in probes.items() if v not in PROBES_EXPECTED[k]} == {}, probes
    assert Path("/proc/sys/kernel/core_pattern").read_text() == core_pattern
    after = os.stat("/dev/null")
    assert (after.st_mode, after.st_mtime_ns) == (null.st_mode, null.st_mtime_ns)


@isolated
def test_nothing_in_the_namespace_can_be_signalled_or_traced():
    """The program sees one other process at most (a root trainer's bwrap init: root, with no
    capabilities) and can neither signal nor trace it; under a normal trainer it is PID 1."""
    output, ok = sandbox.python_tool(
        "import ctypes, os\nc = ctypes.CDLL(None)\n"
        "others = [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]\n"
        "print(os.getpid(), others, [(c.kill(p, 9), c.ptrace(16, p, 0, 0)) for p in others])"
    )
    assert ok, output
    if os.geteuid() == 0:
        assert output == "2 [1] [(-1, -1)]", output
    else:
        assert output == "1 [] []", output


@isolated
def test_threads_are_capped_for_every_trainer_uid():
    """3 000 threads asked for, at most THREADS made (RLIMIT_NPROC binds the call's own uid)."""
    output, ok = sandbox.python_tool(THREADS, timeout=20)
    assert ok and 0 < int(output) < sandbox.THREADS, output


def run_trainer(code):
    """A trainer in a fresh interpreter (as this user) running `code` with the tool imported."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {str(REPO)!r})\nfrom envs import sandbox\n{code}",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


STUBBORN = (
    "import ctypes, os, signal, time\nctypes.CDLL(None).prctl(1, 0)\n"
    "for s in (1, 2, 15): signal.signal(s, signal.SIG_IGN)\nos.setsid()\ntime.sleep(60)"
)


@isolated
def test_a_stubborn_program_dies_with_its_timeout_and_with_a_killed_trainer():
    """A program that tries to clear its parent-death signal, ignores signals and leaves its
    session: gone at its timeout, and gone when its trainer is SIGKILLed mid-call."""
    result, program, before = watched_call(STUBBORN, 2)
    assert result == ("error: timed out after 2 s", False)
    assert process_state(program) == "gone"
    trainer = run_trainer(f"sandbox.python_tool({STUBBORN!r}, timeout=60)")
    program = program_pid(before, trainer.pid)
    trainer.kill()
    trainer.wait()
    deadline = time.time() + 5
    while process_state(program) not in ("gone", "Z") and time.time() < deadline:
        time.sleep(0.05)
    # a zombie at most, where this machine's PID 1 reaps no orphan
    assert process_state(program) in ("gone", "Z")


@isolated
def test_the_timeout_kills_the_namespace_by_itself(monkeypatch):
    """Without bwrap's parent-death signal, the pidfd kill alone ends a stubborn call at its
    timeout: the namespace's first process is killed, not only bwrap."""
    command = sandbox.bwrap_command
    monkeypatch.setattr(
        sandbox,
        "bwrap_command",
        lambda *a: [arg for arg in command(*a) if arg != "--die-with-parent"],
    )
    result, program, _ = watched_call(STUBBORN, 2)
    assert result == ("error: timed out after 2 s", False)
    time.sleep(0.2)
    assert process_state(program) in ("gone", "Z")  # Z: left to a PID 1 that reaps nothing


def process_state(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


@isolated
def test_no_zombie_is_left_to_a_subreaping_trainer():
    """A trainer that reaps orphans (PID 1 of a container, a subreaper) keeps no zombie after
    calls that finish, fail and time out."""
    trainer = run_trainer(
        "import ctypes, os\nctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER\n"
        f"for code in ['print(1)', 'raise SystemExit(3)', {STUBBORN!r}, 'while True: pass']:\n"
        "    sandbox.python_tool(code, timeout=1)\n"
        "zombies = []\nfor stat in os.listdir('/proc'):\n"
        "    try:\n        fields = open(f'/proc/{stat}/stat').read().rsplit(')', 1)[1].split()\n"
        "    except (OSError, ValueError):\n        continue\n"
        "    if fields[0] == 'Z' and int(fields[1]) == os.getpid():\n        zombies.append(stat)\n"
        "print(zombies)"
    )
    output, _ = trainer.communicate(timeout=120)
    assert output.strip() == "[]", output


def test_a_root_suite_isolates(monkeypatch):
    """Where the suite runs as root on Linux (CI, and `make`, which installs bubblewrap), the
    isolation tests above run: they are never skipped there."""
    if os.geteuid() != 0 or sys.platform != "linux":
        pytest.skip("runs where the suite runs as root on Linux")
    assert PROBLEM is None
