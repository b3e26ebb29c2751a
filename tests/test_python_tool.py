"""sandbox.python_tool: model-written code runs isolated at the OS level. Each hostile program
below is checked from outside: no file appears anywhere we watch, no packet reaches a loopback
listener, no process is left, no secret or gold answer is printed, and the trainer is untouched."""

import ctypes
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from envs import sandbox

pytestmark = pytest.mark.skipif(
    not sandbox.sandbox_isolates(), reason="needs bubblewrap")

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
    subprocess.run(["git", "-C", str(base / "repo"), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-qm", "gold", "--allow-empty"], check=True)
    subprocess.run(["git", "-C", str(base / "repo"), "add", "gold.txt"], check=True)
    subprocess.run(["git", "-C", str(base / "repo"), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-qm", "gold"], check=True)
    yield {"dir": base, "udp": udp, "tcp": tcp, "udp6": udp6, "unix": unix, "pid": os.getpid()}
    del os.environ["AGENTFLOW_SECRET"]


def hostile_programs(o):
    d, pid = o["dir"], o["pid"]
    udp, tcp, udp6 = (
        o["udp"].getsockname()[1], o["tcp"].getsockname()[1], o["udp6"].getsockname()[1])
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
        "fill the disk": "\n".join(["for i in range(64):",
                                     "    open(f'fill{i}', 'wb').write(b'x' * (1 << 20))"]),
        "a setuid helper": "import os; os.execv('/usr/bin/passwd', ['passwd', '-S', 'root'])",
    }


def untouched(o, readme_before):
    left = [p.name for p in o["dir"].iterdir()
            if p.name not in ("gold.jsonl", "unix.sock", "repo")]
    assert left == [], left
    assert (REPO / "README.md").read_bytes() == readme_before
    assert not Path("/dev/shm/pwned_k").exists() and not Path("/var/tmp/pwned_k").exists()
    assert not Path("/tmp/e").exists()
    for sock in (o["udp"], o["udp6"], o["unix"]):
        with pytest.raises(BlockingIOError):
            sock.recv(1)
    with pytest.raises(BlockingIOError):
        o["tcp"].accept()
    owners = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                owners.append(proc.stat().st_uid)
            except FileNotFoundError:
                pass
    assert sandbox.SANDBOX_UID not in owners  # no process of the sandbox is left
    assert not Path("/run/lock/pwned_l").exists()
    assert str(SHM_KEY) not in Path("/proc/sysvipc/shm").read_text()  # its IPC namespace is gone


def test_hostile_programs_have_no_effect_outside(outside):
    readme_before = (REPO / "README.md").read_bytes()
    programs = hostile_programs(outside)
    assert len(programs) >= 20
    for name, code in programs.items():
        start = time.time()
        output, _ = sandbox.python_tool(
            code, timeout=3, hidden_files=[outside["dir"] / "gold.jsonl"])
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


def test_ordinary_numpy_and_sympy_code_gets_the_right_answer(outside):
    output, ok = sandbox.python_tool(
        "import numpy as np, sympy as sp\n"
        "print(int(np.arange(10).sum()), sp.factorint(360), sp.solve('x**2 - 4'))"
    )
    assert ok and output == "45 {2: 3, 3: 2, 5: 1} [-2, 2]"
    output, ok = sandbox.python_tool(
        "open('notes.txt', 'w').write('hi'); print(open('notes.txt').read())")
    assert ok and output == "hi"


def test_works_from_a_symlinked_virtual_environment(tmp_path):
    """A venv whose real folder lies under /tmp (a tmpfs inside the sandbox), reached through a
    symlink under runs/, still runs the tool, in that venv."""
    import shutil
    import subprocess
    import sys
    import venv

    venv.create(tmp_path / "venv", with_pip=False)
    link = REPO / "runs" / f"venv-link-{os.getpid()}"
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(tmp_path / "venv", target_is_directory=True)
    call = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from envs import sandbox; "
            "print(sandbox.python_tool('import sys; print(sys.prefix)')[0])")
    try:
        done = subprocess.run([str(link / "bin" / "python"), "-c", call], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
    finally:
        link.unlink()
        shutil.rmtree(tmp_path / "venv")
    # the program ran in that venv (under /tmp, which the sandbox otherwise replaces by a tmpfs)
    ran_in = done.stdout.strip()
    assert ran_in == str((tmp_path / "venv").resolve()), ran_in + done.stderr[-500:]


@pytest.mark.parametrize("code", [
    "import os\nos.makedirs('/'.join(['d'] * 1200))",  # a cleanup that used to recurse too deep
    "import os, time\nos.setsid()\nwhile True: open('x', 'w').write('y')",  # keeps writing
])
def test_no_program_makes_the_tool_raise(code):
    output, ok = sandbox.python_tool(code, timeout=2)
    assert isinstance(output, str) and ok is False
