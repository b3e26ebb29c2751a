"""The isolated Python tool: model-written code runs in its own namespaces, as an unprivileged user,
with no network, no children, nothing of the machine but the interpreter, resource caps and a
timeout.

    python_tool(code, ...)   run one program and return (output, ok); it never raises
    sandbox_isolates()       whether this machine can give the OS-level isolation (bubblewrap)
"""

import ctypes
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


# Isolation by allow-list, through bubblewrap (`bwrap`, the sandbox behind Flatpak; the Makefile
# installs it where the machine allows). Each call gets new user, mount, PID, network, IPC, UTS and
# cgroup namespaces and a new session. Its root holds only /usr, the interpreter and its venv
# (read-only, by their real paths), a minimal /dev and its own /proc, and size-capped tmpfs
# folders (WORK, the working directory, and /tmp) that exist only inside it: the repository, its
# .git and data, runs/, home folders, /run and every socket path are absent. It runs as the
# unprivileged uid SANDBOX_UID with NO_NEW_PRIVS (set-id programs gain nothing), a fresh session
# keyring (and, in its user namespace, a fresh user keyring), a process limit of 1 (no children),
# CPU, memory, file-size and open-file caps and an empty environment. Killing bwrap kills the PID
# namespace's first process and with it every process inside, whatever it did (setsid included).
SANDBOX_UID = 65534  # "nobody"
TMPFS_MB = 16  # each of WORK and /tmp: the program's total writes are bounded
WORK = "/sandbox"  # its working folder, a tmpfs inside its namespaces

SANDBOX_BOOT = r"""
import ctypes, os, resource, sys
memory_mb, cpu_s, file_mb, python, uid, keyctl = sys.argv[1:]
mb = 1 << 20
for limit, value in [(resource.RLIMIT_AS, int(memory_mb) * mb), (resource.RLIMIT_CPU, int(cpu_s)),
                     (resource.RLIMIT_FSIZE, int(file_mb) * mb), (resource.RLIMIT_NOFILE, 64),
                     (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, 1)]:
    resource.setrlimit(limit, (value, value))
os.setgroups([]); os.setgid(int(uid)); os.setuid(int(uid))  # drops every capability
if int(keyctl):  # KEYCTL_CLEAR the user keyring: no notes from an earlier run
    ctypes.CDLL(None).syscall(int(keyctl), 7, -4)
threads = {k: "1" for k in ["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"]}
os.execve(python, [python, "-I", "-B", "main.py"], threads)
"""
KEYCTL = {"x86_64": 250, "aarch64": 219}  # the keyctl syscall number
KEYCTL_JOIN_SESSION_KEYRING = 1


def new_session_keyring():
    """Join a new, empty, anonymous session keyring (keyctl(2)): the trainer's keys stay out of
    reach of what runs next."""
    number = KEYCTL.get(platform.machine())
    if number is not None:
        ctypes.CDLL(None, use_errno=True).syscall(number, KEYCTL_JOIN_SESSION_KEYRING, None)


def bwrap_command(python, prefixes, code_fd, memory_mb, timeout, hidden):
    """The bwrap command line: the allow-listed root (see above), then SANDBOX_BOOT's caps."""
    root = ["--ro-bind", "/usr", "/usr"]
    for top in ["/bin", "/lib", "/lib64", "/sbin"]:  # merged-/usr links, or the folders
        if os.path.islink(top):
            root += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            root += ["--ro-bind", top, top]
    parents = sorted({str(up) for path in prefixes for up in Path(path).parents} - {"/"})
    for parent in parents:  # traversable by SANDBOX_UID, whatever the host's modes
        root += ["--perms", "0755", "--dir", parent]
    for path in prefixes:
        root += ["--ro-bind", path, path]
    for path in hidden:  # data under an allowed folder (e.g. inside the venv) reads as empty
        if any(path.startswith(p + "/") for p in ["/usr", *prefixes]) and os.path.isfile(path):
            root += ["--ro-bind", "/dev/null", path]
    size = str(TMPFS_MB << 20)
    return [
        "bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
        "--unshare-cgroup", "--die-with-parent", "--new-session", "--clearenv",
        "--proc", "/proc", "--dev", "/dev",
        *(arg for folder in ["/dev/shm", "/tmp", WORK]  # writable by SANDBOX_UID, size-capped
          for arg in ["--perms", "1777", "--size", size, "--tmpfs", folder]),
        *root,  # after the tmpfs folders, so a venv under /tmp is bound on top of its tmpfs
        "--file", str(code_fd), f"{WORK}/main.py",
        "--chdir", WORK, "--", python, "-I", "-c", SANDBOX_BOOT, str(memory_mb),
        str(int(timeout) + 1), "1", python, str(SANDBOX_UID),
        str(KEYCTL.get(platform.machine(), 0))]


def sandbox_isolates():
    """True when each Python tool call can run under bubblewrap here; checked once, and a
    machine without it is told so in one line."""
    if not hasattr(sandbox_isolates, "ok"):
        sandbox_isolates.ok = shutil.which("bwrap") is not None and run_program(
            "print(1)", 30, 256, 100, (), isolate=True) == ("1", True)
        if not sandbox_isolates.ok:
            print(
                "WARNING: the Python tool runs WITHOUT OS-level isolation (needs bubblewrap and "
                "user namespaces): only resource limits, an empty environment and a temp folder "
                "apply; network, file reads, writes the user may make and child processes are NOT "
                "blocked.", file=sys.stderr)
    return sandbox_isolates.ok


def python_tool(code, timeout=10.0, memory_mb=1024, max_output=2000, hidden_files=()):
    """Run model-written code in an isolated process and return (output, ok); never raises.

    Output is stdout plus the last stderr line on failure, cut at `max_output` characters; a run
    past `timeout` seconds is killed with everything it started. `hidden_files` (the run's data)
    are absent, or read as empty where they lie under a folder the program may read. A failure of
    the tool itself is an error observation for the agent, never an exception in the trainer.
    """
    try:
        hidden = [str(Path(f).resolve()) for f in hidden_files]
        return run_program(code, timeout, memory_mb, max_output, hidden, sandbox_isolates())
    except Exception as err:  # noqa: BLE001 - by contract: an observation, not a crash
        return f"error: the Python tool failed ({type(err).__name__})", False


def run_program(code, timeout, memory_mb, max_output, hidden, isolate):
    """One run: the program, its output files, the kill at the timeout (python_tool)."""
    import resource

    with tempfile.TemporaryDirectory(prefix="agentflow_py_", ignore_cleanup_errors=True) as tmp:
        tmp = Path(tmp)
        (tmp / "main.py").write_text(code)
        fds = []
        with open(tmp / "stdout", "wb") as stdout, open(tmp / "stderr", "wb") as stderr:
            # the venv's own interpreter, reached through the real path of its folder
            python = str(Path(sys.executable).parent.resolve() / Path(sys.executable).name)
            if isolate:
                prefixes = sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)}
                                  - {"/usr"})
                fds = [os.open(tmp / "main.py", os.O_RDONLY)]
                command = bwrap_command(python, prefixes, fds[0], memory_mb, timeout, hidden)
                preexec, cwd = new_session_keyring, "/"
            else:
                command, cwd = [sys.executable, "-I", "-B", "main.py"], tmp

                def preexec():
                    for limit, value in [
                        (resource.RLIMIT_AS, memory_mb << 20), (resource.RLIMIT_FSIZE, 1 << 20),
                        (resource.RLIMIT_CPU, int(timeout) + 1)]:
                        resource.setrlimit(limit, (value, value))

            try:
                process = subprocess.Popen(
                    command, cwd=cwd, env={}, stdin=subprocess.DEVNULL, stdout=stdout,
                    stderr=stderr, preexec_fn=preexec, start_new_session=True, pass_fds=fds)
            finally:
                for fd in fds:
                    os.close(fd)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # bwrap: its PID namespace goes too
                process.wait()
                for _ in range(200):  # until the killed group has exited (at most 2 s more)
                    try:
                        os.killpg(process.pid, 0)
                    except ProcessLookupError:
                        break
                    time.sleep(0.01)
                return f"error: timed out after {timeout:g} s", False
        text = (tmp / "stdout").read_bytes()[: max_output + 1].decode("utf-8", "replace")
        errors = (tmp / "stderr").read_bytes()[-2000:].decode("utf-8", "replace")
    errors = errors.strip().splitlines()
    if process.returncode and errors:
        text += "\n" + errors[-1]
    text = text.strip() or (
        "(no output; print the result)" if process.returncode == 0
        else f"error: exit status {process.returncode}")
    cut = " …[truncated]" if len(text) > max_output else ""
    return text[:max_output] + cut, process.returncode == 0
