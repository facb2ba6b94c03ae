"""Starting, waiting for and stopping processes, so that nothing is left behind."""
import contextlib
import os
import pathlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

from .paths import ROOT


class Service:
    """A process a script starts: a temporary directory (its configuration files and its
    log), the log, and stopping it (the directory goes with it)."""

    def _workdir(self, name):
        self.dir = tempfile.mkdtemp(prefix=f"kvroute-{name}-")
        self.log_path = os.path.join(self.dir, f"{name}.log")
        return self.dir

    def _spawn(self, cmd, **popen):
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, **popen)

    def logs(self):
        return pathlib.Path(self.log_path).read_text(errors="replace")

    def cpu_seconds(self):
        """User + system CPU time the process has used so far."""
        fields = pathlib.Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss_mb(self):
        """The process's peak resident memory so far (VmHWM), in MB."""
        for line in pathlib.Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self, kill=False):
        stop_process(self.proc, self.log, self.dir, kill)


def prometheus(url, labels=True):
    """A /metrics page as {'name{labels}': value} (labels=False: {'name': value})."""
    out = {}
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k if labels else k.split("{")[0]] = float(v)
    return out


_handed_out = set()
# Its own generator: a script that seeds the module's (for its workload) must not make two
# processes draw the same ports.
_port_rng = random.Random()


def free_port():
    """A port nothing listens on, for a server started later. Taken below the kernel's
    ephemeral range: a port from the range (bind to 0) can be given to some client's
    outgoing connection before the server binds it ("Address already in use"), which
    happened under the stage benchmark's connection churn. Ports are not handed out twice
    in one process; the range's first 12k ports make a clash between processes rare, and
    the test runner's workers (pytest-xdist, and what they start) draw from disjoint parts
    of it."""
    try:
        low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    first, last = max(1024, low - 12000), low
    try:
        worker = int(os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw"))
        workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    except (KeyError, ValueError):
        worker, workers = 0, 1
    if 0 <= worker < workers:
        share = (last - first) // workers
        first, last = first + worker * share, first + (worker + 1) * share
    for _ in range(200 if low > 20000 else 0):
        port = _port_rng.randrange(first, last)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ready_or_stop(server, wait):
    """Runs `wait`; if it does not return (an error, or Ctrl-C: a script's signal handler
    only stops the servers it was handed), stops `server` so no process is left behind."""
    try:
        wait()
    except BaseException:
        server.stop()
        raise


def wait_http_ok(proc, url, what, logs, timeout):
    """Until `url` answers 200; an error with the process's log if it exits or never does."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}:\n{logs()}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} not ready:\n{logs()}")


def stop_process(proc, log, tmpdir, kill=False):
    """Ends a process we started (SIGTERM, or SIGKILL if `kill` or it lingers), closes its
    log and removes its temporary directory."""
    if proc.poll() is None:
        proc.kill() if kill else proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()
    shutil.rmtree(tmpdir, ignore_errors=True)


def wait_for(predicate, timeout=10, interval=0.05, what="condition"):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


class Processes:
    """What a script started (engines, sidecars, Envoys): stopped in reverse order by
    stop_all(), which SIGINT and SIGTERM also call before exiting."""

    def __init__(self):
        import signal
        import sys
        self.items = []

        def on_signal(signum, _frame):
            self.stop_all()
            end_children()
            sys.exit(128 + signum)

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)

    def add(self, p):
        self.items.append(p)
        return p

    def stop(self, p):
        p.stop()
        self.items.remove(p)

    def stop_all(self):
        for p in reversed(self.items):
            try:
                p.stop()
            except Exception:  # noqa: BLE001 — best effort: stop the rest
                pass
        self.items.clear()


def end_children(grace=10):
    """SIGTERM (SIGKILL after `grace` seconds) to every child this process still has. A
    signal that lands while subprocess.Popen waits for its child's exec raises out of
    Popen and leaves a running child no object holds."""
    import signal
    me = os.getpid()
    children = []
    for p in pathlib.Path("/proc").iterdir():
        try:
            if p.name.isdigit() and int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == me:
                children.append(int(p.name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.time() + grace
    for pid in children:
        try:
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                if time.time() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.02)
        except (ChildProcessError, ProcessLookupError):
            pass  # already reaped
