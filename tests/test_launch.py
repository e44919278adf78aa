"""``jaxpar run`` starts real processes under jax.distributed; ``jaxpar.init`` reads the
cluster from the environment; the launcher stops every rank when one fails."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxpar._src.errors import ContextError
from jaxpar._src.launch import launcher
from jaxpar._src.launch.comm import cluster_env
from jaxpar._src.launch.launcher import LaunchConfig, worker_env
from tests.util import FAST_COMPILE_FLAGS

MP = Path(__file__).parent / "mp"
ROOT = Path(__file__).parent.parent
JAXPAR = Path(sys.executable).parent / "jaxpar"  # the console script of this environment


def _env(**extra: str) -> dict[str, str]:
    """This environment without the test session's own device count or cluster."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"))}
    env["XLA_FLAGS"] = FAST_COMPILE_FLAGS  # no device count: the launcher gives each its own
    env["PYTHONPATH"] = str(ROOT)
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead; it only waits for its parent (pid 1 here) to reap it
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# -- the same step on 2 processes x 4 devices and on 1 process x 8 devices --------------------
@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """What tests/mp/train.py writes as one process driving 8 devices."""
    out = tmp_path_factory.mktemp("one") / "single.npz"
    run = subprocess.run([sys.executable, str(MP / "train.py"), str(out)],
                         env=_env(JAX_NUM_CPU_DEVICES="8"), cwd=out.parent,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rank 0 of 1: done" in run.stdout
    return np.load(out)


def _assert_same_training(a, b):
    assert sorted(a.files) == sorted(b.files)
    assert len(a.files) == 7  # three ways x two weights, and the loss history
    for name in a.files:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert not np.allclose(a["dp_w1"], a["megatron_w1"], atol=0)  # 4 steps against 3
    assert a["history"].shape == (4,) and a["history"][-1] < a["history"][0]  # 2 epochs x 2


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path, one_process):
    out = tmp_path / "multi.npz"
    run = subprocess.run(
        [str(JAXPAR), "run", "-n", "2", "--devices-per-process", "4", "--log-dir",
         str(tmp_path / "logs"), "--timeout", "240", str(MP / "train.py"), str(out)],
        env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "rank 0 of 2: done" in run.stdout  # rank 0 streamed to the terminal
    assert "rank 1 of 2: done" in (tmp_path / "logs" / "worker_1.log").read_text()
    assert "rank 1" not in run.stdout  # ... and only rank 0
    _assert_same_training(np.load(out), one_process)


@pytest.mark.slow
def test_two_hosts_match_one_process(tmp_path, one_process):
    """The several-host command, with both "hosts" on this machine: two launchers, one
    process each, joined through host 0's address."""
    address = socket.gethostbyname(socket.gethostname())
    if address == "127.0.0.1":  # the launcher refuses loopback for several hosts
        address = "127.0.0.2"  # ... which is still this machine
    port = str(launcher.free_port())
    out = tmp_path / "hosts.npz"
    nodes = [subprocess.Popen(
        [str(JAXPAR), "run", "-n", "1", "--devices-per-process", "4", "--nnodes", "2",
         "--node-rank", str(rank), "--master-addr", address, "--master-port", port,
         "--log-dir", str(tmp_path / f"node{rank}"), "--timeout", "240", str(MP / "train.py"),
         str(out)], env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (stdout, stderr) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "rank 0 of 2: done" in outputs[0][0]
    assert "rank 1 of 2: done" in outputs[1][0]  # host 1's first rank is rank 1
    assert (tmp_path / "node1" / "worker_1.log").exists()
    _assert_same_training(np.load(out), one_process)


@pytest.mark.slow
def test_the_readme_example_runs_on_two_processes(tmp_path):
    run = subprocess.run(
        [str(JAXPAR), "run", "-n", "2", "--devices-per-process", "4", "--timeout", "240",
         str(ROOT / "examples" / "digits_data_parallel.py"), "--smoke"],
        env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 all-reduce" in run.stdout and "over 8 devices" in run.stdout
    accuracy = float(re.search(r"test accuracy ([\d.]+)", run.stdout).group(1))
    assert accuracy > 0.7


# -- stopping ----------------------------------------------------------------------------------
def _start_sleepers(tmp_path: Path, n: int = 2, *extra: str) -> subprocess.Popen:
    pids = tmp_path / "pids"
    pids.mkdir()
    return subprocess.Popen(
        [sys.executable, "-m", "jaxpar", "run", "-n", str(n), "--devices-per-process", "1",
         "--log-dir", str(tmp_path / "logs"), *extra, str(MP / "sleeper.py"), str(pids)],
        env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)


def _wait_for_pids(tmp_path: Path, n: int, proc: subprocess.Popen) -> dict[int, list[int]]:
    end = time.monotonic() + 120
    pids: dict[int, list[int]] = {}
    while len(pids) < n:
        assert time.monotonic() < end, "the ranks did not start"
        assert proc.poll() is None, proc.communicate()
        for r in range(n):
            f = tmp_path / "pids" / f"rank_{r}.pids"
            if f.exists():
                pids[r] = [int(p) for p in f.read_text().split()]
        time.sleep(0.1)
    return pids


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline and _alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def _assert_all_gone(tmp_path: Path) -> None:
    """No rank and no child of a rank is left (every one names the pid directory)."""
    end = time.monotonic() + 10  # a killed process may take a moment to be reaped
    while time.monotonic() < end and _processes_naming(str(tmp_path / "pids")):
        time.sleep(0.1)
    assert not _processes_naming(str(tmp_path / "pids")), "processes left behind"


def test_killing_one_rank_stops_the_others(tmp_path):
    proc = _start_sleepers(tmp_path, 3)
    try:
        pids = _wait_for_pids(tmp_path, 3, proc)
        os.kill(pids[1][0], signal.SIGKILL)
        start = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert took < 10, took  # SIGTERM reaches the sleepers at once; the grace period is 5 s
    assert "rank 1 failed (signal SIGKILL)" in err
    assert "stopped the other 2 running ranks" in err
    assert "rank 1 waiting" in err  # the tail of its log
    assert "rank 0 waiting" in out  # rank 0 streamed
    _assert_all_gone(tmp_path)


@pytest.mark.parametrize("how, status, line", [
    ("JAXPAR_TEST_FAIL_RANK", 1, "RuntimeError: injected failure on rank 1"),
    ("JAXPAR_TEST_EXIT_RANK", 3, "rank 1 exits with status 3"),  # sys.exit(3), no exception
])
def test_a_failing_rank_is_named_at_once(tmp_path, how, status, line):
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "jaxpar", "run", "-n", "2", "--devices-per-process", "4",
         "--log-dir", "logs", str(MP / "train.py"), "unused.npz"],
        env=_env(**{how: "1"}), cwd=tmp_path, capture_output=True, text=True,
        timeout=180)
    took = time.monotonic() - start
    assert run.returncode == status
    # rank 1 does not wait in JAX's shutdown barrier for rank 0, which waits for rank 1
    assert f"rank 1 failed (exit status {status})" in run.stderr, run.stderr[-3000:]
    assert line in run.stderr  # the tail of its log
    assert took < 60, took  # rank 0 alone would give up on rank 1 only after minutes
    assert (tmp_path / "logs" / "worker_0.log").exists()
    assert (tmp_path / "logs" / "worker_1.log").exists()


def test_rank_runner_runs_the_script_as_python_would(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import sys, os\n"
                      "print(__name__, sys.argv, sys.path[0] == os.path.dirname(__file__))\n"
                      "sys.exit(int(sys.argv[1]))\n")
    for code in (0, 3):
        run = subprocess.run(list(launcher.script_command(str(script), [str(code)])),
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == code
        assert run.stdout == f"__main__ [{str(script)!r}, '{code}'] True\n"
    run = subprocess.run(list(launcher.script_command(str(script), ["x"])),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "ValueError" in run.stderr


def test_timeout_stops_everything(tmp_path):
    proc = _start_sleepers(tmp_path, 2, "--timeout", "20")
    try:
        _wait_for_pids(tmp_path, 2, proc)  # the ranks and their children are up
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 124
    assert "timed out after 20 s" in err
    _assert_all_gone(tmp_path)


def test_ctrl_c_stops_everything(tmp_path):
    proc = _start_sleepers(tmp_path, 2)
    try:
        _wait_for_pids(tmp_path, 2, proc)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGINT
    assert "SIGINT received; stopping all 2 processes" in err
    _assert_all_gone(tmp_path)


def test_killing_the_launcher_takes_its_ranks_along(tmp_path):
    proc = _start_sleepers(tmp_path, 2)
    pids: dict[int, list[int]] = {}
    try:
        pids = _wait_for_pids(tmp_path, 2, proc)
        # no chance to clean up: the kernel stops the ranks (PR_SET_PDEATHSIG); what a rank
        # started itself is the rank's to stop, and the finally below does it here
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        end = time.monotonic() + 10
        while time.monotonic() < end and any(_alive(ps[0]) for ps in pids.values()):
            time.sleep(0.1)
        assert not [ps[0] for ps in pids.values() if _alive(ps[0])], "ranks left behind"
    finally:
        for ps in pids.values():
            for p in ps:
                if _alive(p):
                    os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("argv, message", [
    (["run", "-n", "0", "x.py"], "-n must be at least 1"),
    (["run", "-n", "2", "--devices-per-process", "0", "x.py"], "at least 1"),
    (["run", "-n", "2", "--nnodes", "2", "--node-rank", "2", "x.py"], "--node-rank must be"),
    (["run", "-n", "2", "--nnodes", "2", "x.py"], "several hosts need --master-addr"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    from jaxpar._src.launch.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


# -- the environment each rank sees, and how init() reads it -----------------------------------
def test_worker_env_numbers_ranks_across_hosts():
    config = LaunchConfig(nproc=4, command=("python", "t.py"), devices_per_process=2,
                          nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=9000)
    env = worker_env(config, 3, 9000, base={
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/d",
        "http_proxy": "http://proxy:3128"})
    assert env["JAX_COORDINATOR_ADDRESS"] == "10.0.0.1:9000"
    assert env["JAX_NUM_PROCESSES"] == "8"
    assert env["JAX_PROCESS_ID"] == "7"
    assert env["JAXPAR_LOCAL_RANK"] == "3"
    assert env["JAX_NUM_CPU_DEVICES"] == "2"
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"  # the device count flag alone removed
    assert "http_proxy" not in env
    parsed = cluster_env(env)
    assert (parsed.coordinator, parsed.num_processes, parsed.process_id) == \
        ("10.0.0.1:9000", 8, 7)


@pytest.mark.parametrize("environ, expected", [
    ({}, None),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"},
     ("h:1", 4, 2, "jaxpar run / JAX")),
    ({"COORDINATOR_ADDRESS": "job-worker-0", "COORDINATOR_PORT": "6666",
      "NUM_PROCESSES": "3", "PROCESS_ID": "0"}, ("job-worker-0:6666", 3, 0, "Kubeflow JAXJob")),
    ({"COORDINATOR_ADDRESS": "job-worker-0", "NUM_PROCESSES": "3", "PROCESS_ID": "2"},
     ("job-worker-0:6666", 3, 2, "Kubeflow JAXJob")),  # the operator's default port
])
def test_cluster_env(environ, expected):
    env = cluster_env(environ)
    if expected is None:
        assert env is None
    else:
        assert (env.coordinator, env.num_processes, env.process_id, env.source) == expected


@pytest.mark.parametrize("environ, message", [
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "0"}, "not a valid process count"),
    ({"COORDINATOR_ADDRESS": "h", "NUM_PROCESSES": "two", "PROCESS_ID": "0"}, "'two'"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
     r"process id 2 is not in \[0, 2\)"),
])
def test_cluster_env_errors(environ, message):
    with pytest.raises(ContextError, match=message):
        cluster_env(environ)


def test_script_command():
    runner = launcher.RANK_MAIN
    assert launcher.script_command("t.py", ["--x", "1"]) == (sys.executable, "-u", runner, "t.py",
                                                              "--x", "1")
    assert launcher.script_command("-m", ["pkg.mod", "a"]) == (sys.executable, "-u", runner, "-m",
                                                                "pkg.mod", "a")


def test_single_process_init_is_a_no_op():
    import jaxpar

    jaxpar.init()
    assert (jaxpar.get_rank(), jaxpar.get_group_size(), jaxpar.get_local_rank()) == (0, 1, 0)


def test_help_names_the_commands():
    out = subprocess.run([str(JAXPAR), "--help"], capture_output=True, text=True, timeout=60,
                         env=_env())
    assert out.returncode == 0
    assert re.search(r"run\b.*\n?.*k8s", out.stdout, re.S)
