"""A job that joins the cluster, records its pids and waits: the launcher's stop tests.

    jaxpar run -n 2 tests/mp/sleeper.py PID_DIR

Each rank starts one child of its own (to check that a rank's children are stopped too; its
command line names PID_DIR as well), writes ``PID_DIR/rank_<r>.pids`` (its pid and the
child's) and sleeps until it is stopped.
"""

import os
import subprocess
import sys
import time

import jaxpar

jaxpar.init()

if __name__ == "__main__":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1]])
    rank = jaxpar.get_rank()
    path = os.path.join(sys.argv[1], f"rank_{rank}.pids")
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}\n")
    os.replace(path + ".tmp", path)
    print(f"rank {rank} waiting", flush=True)
    time.sleep(600)
