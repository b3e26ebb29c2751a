"""The isolated Python tool: model-written code runs in its own namespaces, as an unprivileged user,
with no network, no children, no reads or writes outside its folder, resource caps and a timeout.

    python_tool(code, ...)   run one program and return (output, ok)
    sandbox_isolates()       whether this machine can give the OS-level isolation (root + unshare)
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


# The Python tool runs model-written code. Where the machine allows it (root and util-linux
# `unshare`), each call gets new mount, network and PID namespaces: only a down loopback (no
# network), a /proc that shows only itself, fresh tmpfs over /tmp, /var/tmp, /dev/shm, /root and
# /home (nothing written there survives, nothing secret there is readable), the run's data files
# replaced by /dev/null, and its own empty working directory. It then drops to the unprivileged uid
# SANDBOX_UID, whose process limit of 1 forbids children, with CPU, memory, file-size and open-file
# caps, an empty environment, and output into files the trainer reads at most `max_output`
# characters of. No guard state lives in the model's process.
SANDBOX_UID = 65534  # "nobody"


SANDBOX_BOOT = r"""
import os, resource, subprocess, sys
work, code_path, python, uid, memory_mb, cpu_s, file_mb, *hidden = sys.argv[1:]
uid, mb = int(uid), 1 << 20
def mount(*args):
    subprocess.run(["mount", *args], check=True)
mount("-t", "tmpfs", "-o", "mode=755,size=1m", "tmpfs", "/mnt")
os.mkdir("/mnt/work"); os.mkdir("/mnt/py")
mount("--bind", work, "/mnt/work")
# the interpreter and its venv, read-only, by their real paths (a venv may be a symlink)
prefixes = sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)})
keep = [(p, f"/mnt/py/{n}") for n, p in enumerate(prefixes)]
for source, target in keep:
    os.mkdir(target); mount("--bind", source, target); mount("-o", "remount,bind,ro", target)
for folder in ["/tmp", "/var/tmp", "/dev/shm", "/root", "/home"]:
    if os.path.isdir(folder):
        mount("-t", "tmpfs", "-o", "mode=755,size=16m", "tmpfs", folder)
for source, target in keep:
    if not os.path.isdir(source):
        os.makedirs(source); mount("--bind", target, source)
for path in hidden:
    if os.path.isfile(path):
        mount("--bind", "/dev/null", path)
os.chdir("/mnt/work")
for limit, value in [(resource.RLIMIT_AS, int(memory_mb) * mb), (resource.RLIMIT_CPU, int(cpu_s)),
                     (resource.RLIMIT_FSIZE, int(file_mb) * mb), (resource.RLIMIT_NOFILE, 64),
                     (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, 1)]:
    resource.setrlimit(limit, (value, value))
os.setgroups([]); os.setgid(uid); os.setuid(uid)
# no helper threads
threads = {k: "1" for k in ["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"]}
os.execve(python, [python, "-I", "-B", code_path], threads)
"""


def sandbox_isolates():
    """True when each Python tool call can get its own namespaces (root + `unshare`); checked
    once."""
    if not hasattr(sandbox_isolates, "ok"):
        trial = ["unshare", "--mount", "--net", "--pid", "--fork", "--mount-proc", "true"]
        sandbox_isolates.ok = (
            os.geteuid() == 0
            and shutil.which("unshare") is not None
            and subprocess.run(trial, capture_output=True).returncode == 0
        )
        if not sandbox_isolates.ok:
            print(
                "WARNING: the Python tool runs WITHOUT OS-level isolation (needs root and "
                "util-linux `unshare`): only resource limits, an empty environment and a temp "
                "folder apply; network, "
                "file reads, writes the user may make, and child processes are NOT blocked.",
                file=sys.stderr,
            )
    return sandbox_isolates.ok


def python_tool(code, timeout=10.0, memory_mb=1024, max_output=2000, hidden_files=()):
    """Run model-written code in an isolated process (see SANDBOX_BOOT) and return (output, ok).

    Output is stdout plus the last stderr line on failure, cut at `max_output` characters; a run
    past `timeout` seconds is killed with everything it started. `hidden_files` (the run's data)
    read as empty.
    """
    import resource

    with (
        tempfile.TemporaryDirectory(prefix="agentflow_py_") as workdir,
        tempfile.TemporaryDirectory(prefix="agentflow_out_") as outdir,
    ):
        work, out = Path(workdir) / "work", Path(outdir)
        work.mkdir()
        (work / "main.py").write_text(code)
        with open(out / "stdout", "wb") as stdout, open(out / "stderr", "wb") as stderr:
            # the venv's own interpreter, reached through the real path of its folder
            python = str(Path(sys.executable).parent.resolve() / Path(sys.executable).name)
            if sandbox_isolates():
                os.chown(work, SANDBOX_UID, SANDBOX_UID)
                os.chmod(workdir, 0o755)
                command = [
                    "unshare", "--mount", "--net", "--pid", "--fork", "--kill-child",
                    "--mount-proc", "--", python, "-I", "-c", SANDBOX_BOOT, str(work),
                    "main.py", python, str(SANDBOX_UID), str(memory_mb),
                    str(int(timeout) + 1), "1", *[str(Path(f).resolve()) for f in hidden_files]]
                limits = None
            else:
                command = [sys.executable, "-I", "-B", "main.py"]

                def limits():
                    for limit, value in [
                        (resource.RLIMIT_AS, memory_mb << 20), (resource.RLIMIT_FSIZE, 1 << 20),
                        (resource.RLIMIT_CPU, int(timeout) + 1)]:
                        resource.setrlimit(limit, (value, value))

            process = subprocess.Popen(
                command, cwd=work, env={}, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                preexec_fn=limits, start_new_session=True)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # with --kill-child, its namespace goes too
                process.wait()
                for _ in range(200):  # until the killed group has exited (at most 2 s more)
                    try:
                        os.killpg(process.pid, 0)
                    except ProcessLookupError:
                        break
                    time.sleep(0.01)
                return f"error: timed out after {timeout:g} s", False
        text = (out / "stdout").read_bytes()[: max_output + 1].decode("utf-8", "replace")
        errors = (
            (out / "stderr").read_bytes()[-2000:].decode("utf-8", "replace").strip().splitlines()
        )
    if process.returncode and errors:
        text += "\n" + errors[-1]
    text = text.strip() or (
        "(no output; print the result)"
        if process.returncode == 0
        else f"error: exit status {process.returncode}"
    )
    return text[:max_output] + (
        " …[truncated]" if len(text) > max_output else ""
    ), process.returncode == 0
