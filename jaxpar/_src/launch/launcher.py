"""``jaxpar run``: start the processes of one host (MindSpore's ``msrun`` for jax.distributed).

Each process gets ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``
(read by :func:`jaxpar.init`), ``JAXPAR_LOCAL_RANK`` and, with ``--devices-per-process``, its
device count (``JAX_NUM_CPU_DEVICES`` on CPU).  Output goes to ``<log-dir>/worker_<rank>.log``;
the host's first rank is also streamed to the terminal.  When a rank fails, the launcher stops
the others (SIGTERM to each process group, SIGKILL after a grace period), names the rank, its
exit status and the tail of its log, and exits non-zero.  Each rank runs its script through
``rank.py``, so that a non-zero exit (``sys.exit(3)``) leaves at once rather than waiting in JAX's
shutdown barrier for ranks that wait for it.  A timeout and Ctrl-C stop everything
the same way (each rank's whole process group), and so does a run that succeeds, for anything
a rank left running.  If the launcher itself is killed outright, the ranks die with it (Linux
``PR_SET_PDEATHSIG``); processes a rank started of its own die with the rank only if it sees
to that.

Several hosts: run the same command on each with ``--nnodes``, ``--node-rank`` and the first
host's ``--master-addr``/``--master-port``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

GRACE_S = 5.0  # between SIGTERM and SIGKILL when stopping ranks
POLL_S = 0.05
DEFAULT_PORT = 8118  # msrun's default master port, for several hosts


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    nproc: int  # processes on this host
    command: tuple[str, ...]  # what each process runs
    devices_per_process: int | None = None
    log_dir: str = "logs"
    timeout: float | None = None  # seconds for the whole run
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (one host only)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def worker_env(config: LaunchConfig, local_rank: int, port: int,
               base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    rank = config.node_rank * config.nproc + local_rank
    env.update({
        "JAX_COORDINATOR_ADDRESS": f"{config.master_addr}:{port}",
        "JAX_NUM_PROCESSES": str(config.world_size),
        "JAX_PROCESS_ID": str(rank),
        "JAXPAR_LOCAL_RANK": str(local_rank),
        "JAXPAR_NODE_RANK": str(config.node_rank),
        "JAXPAR_LOCAL_WORLD_SIZE": str(config.nproc),
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        "PYTHONUNBUFFERED": "1",
    })
    if config.devices_per_process is not None:
        env["JAXPAR_DEVICES_PER_PROCESS"] = str(config.devices_per_process)
        env["JAX_NUM_CPU_DEVICES"] = str(config.devices_per_process)
        # one device count only: the XLA flag would fight JAX_NUM_CPU_DEVICES
        flags = without_device_count(env.get("XLA_FLAGS", ""))
        if flags:
            env["XLA_FLAGS"] = flags
        else:
            env.pop("XLA_FLAGS", None)
    for proxy in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        env.pop(proxy, None)  # the coordinator is local; a proxy would only get in the way
    return env


def without_device_count(xla_flags: str) -> str:
    """``XLA_FLAGS`` without ``--xla_force_host_platform_device_count``.

    >>> without_device_count("--xla_force_host_platform_device_count=8 --xla_dump_to=d")
    '--xla_dump_to=d'
    """
    return re.sub(r"--xla_force_host_platform_device_count=\d+", "", xla_flags).strip()


class Launcher:
    """Runs the processes of one host and watches them; :meth:`run` returns the exit status."""

    def __init__(self, config: LaunchConfig, out: IO[str] | None = None) -> None:
        self.config = config
        self.out = out or sys.stderr
        self.procs: list[subprocess.Popen] = []
        self.logs: list[str] = []
        self._stream: threading.Thread | None = None

    def rank(self, local_rank: int) -> int:
        return self.config.node_rank * self.config.nproc + local_rank

    def say(self, message: str) -> None:
        print(f"jaxpar run: {message}", file=self.out, flush=True)

    def start(self) -> None:
        c = self.config
        port = c.master_port or (free_port() if c.nnodes == 1 else DEFAULT_PORT)
        os.makedirs(c.log_dir, exist_ok=True)
        for local in range(c.nproc):
            path = os.path.join(c.log_dir, f"worker_{self.rank(local)}.log")
            self.logs.append(path)
            log = open(path, "wb")  # noqa: SIM115 - lives as long as the child writes it
            stream = local == 0
            proc = subprocess.Popen(
                list(c.command), env=worker_env(c, local, port), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if stream else log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent)
            if not stream:
                log.close()
            else:
                self._first_log = log
            self.procs.append(proc)
        self._stream = threading.Thread(target=self._tee, daemon=True)
        self._stream.start()
        self.say(f"{c.nproc} processes on this host (ranks {self.rank(0)}-"
                 f"{self.rank(c.nproc - 1)} of {c.world_size}), coordinator "
                 f"{c.master_addr}:{port}, logs in {os.path.abspath(c.log_dir)}")

    def _tee(self) -> None:
        """Rank 0's output to its log and to the terminal."""
        pipe = self.procs[0].stdout
        assert pipe is not None
        terminal = True
        for line in iter(pipe.readline, b""):
            self._first_log.write(line)
            self._first_log.flush()
            if terminal:
                try:
                    sys.stdout.buffer.write(line)
                    sys.stdout.flush()
                except (OSError, ValueError):  # the terminal went away (| head): log only
                    terminal = False
        self._first_log.close()

    def run(self) -> int:
        c = self.config
        deadline = time.monotonic() + c.timeout if c.timeout else None
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        stop: dict[str, int | None] = {"signal": None}
        failed_at: dict[int, float] = {}  # local rank -> when its failure was seen

        def on_signal(signum: int, frame: object) -> None:
            stop["signal"] = signum

        for s in previous:
            signal.signal(s, on_signal)
        try:
            try:
                self.start()
            except BaseException:
                self.stop_all()
                raise
            while True:
                if stop["signal"] is not None:
                    name = signal.Signals(stop["signal"]).name
                    self.say(f"{name} received; stopping all {c.nproc} processes.")
                    self.stop_all()
                    return 128 + stop["signal"]
                codes = [p.poll() for p in self.procs]
                for i, rc in enumerate(codes):
                    if rc not in (None, 0) and i not in failed_at:
                        failed_at[i] = time.monotonic()
                if failed_at:
                    return self._fail(min(failed_at, key=lambda i: (failed_at[i], i)), codes)
                if all(rc == 0 for rc in codes):
                    self._join_stream()
                    for p in self.procs:  # what a rank started and left running
                        _signal_group(p, signal.SIGKILL)
                    return 0
                if deadline is not None and time.monotonic() > deadline:
                    running = [self.rank(i) for i, rc in enumerate(codes) if rc is None]
                    self.say(f"timed out after {c.timeout:g} s with ranks {running} still "
                             f"running; stopping them.")
                    self.stop_all()
                    return 124
                time.sleep(POLL_S)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _fail(self, local: int, codes: list[int | None]) -> int:
        """Stops the rest after ``local`` failed; if others had failed in the same poll they
        are listed too (``local`` is the one seen first, the lowest rank on a tie)."""
        code = codes[local]
        assert code is not None
        others = [i for i, p in enumerate(self.procs) if i != local and p.poll() is None]
        also = [f"rank {self.rank(i)} ({_status(rc)})" for i, rc in enumerate(codes)
                if i != local and rc not in (None, 0)]
        self.stop_all()
        self._join_stream()
        tail = _tail(self.logs[local])
        also_text = f" Also failed: {', '.join(also)}." if also else ""
        self.say(f"rank {self.rank(local)} failed ({_status(code)}); stopped the other "
                 f"{len(others)} running ranks.{also_text} Last lines of "
                 f"{self.logs[local]}:\n{tail}")
        return code if code > 0 else 128 - code

    def stop_all(self) -> None:
        """SIGTERM to every rank's process group, SIGKILL to those still alive after a grace
        period."""
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            _signal_group(p, signal.SIGTERM)
        end = time.monotonic() + GRACE_S
        while any(p.poll() is None for p in alive) and time.monotonic() < end:
            time.sleep(POLL_S)
        for p in self.procs:  # the groups too: a rank's own children must not survive it
            _signal_group(p, signal.SIGKILL)
            try:
                p.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable
                pass

    def _join_stream(self) -> None:
        if self._stream is not None:
            self._stream.join(timeout=GRACE_S)


def _status(code: int) -> str:
    return f"exit status {code}" if code > 0 else f"signal {signal.Signals(-code).name}"


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return "  (no log)"
    return "\n".join("  " + line for line in text.splitlines()[-lines:]) or "  (empty log)"


def launch(config: LaunchConfig) -> int:
    """Runs ``config`` to completion; the exit status for the shell."""
    return Launcher(config).run()


RANK_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank.py")


def script_command(script: str, args: Sequence[str]) -> tuple[str, ...]:
    """The command for a script (``script.py ...``) or a module (``-m pkg.mod ...``), run by
    ``rank.py`` so that a rank exiting non-zero leaves at once (see ``rank.py``)."""
    return (sys.executable, "-u", RANK_MAIN, script, *args)
