"""What ``jaxpar run`` starts in each rank: the user's script, and a quick exit on failure.

    python -u rank.py SCRIPT ARGS...        (or: rank.py -m MODULE ARGS...)

JAX registers ``jax.distributed.shutdown`` with ``atexit``: a process leaving normally waits
there, in a barrier, for every other rank.  A rank that ends with a non-zero status through
``sys.exit(3)`` or ``raise SystemExit(3)`` would wait there too, for ranks that in turn wait for
it (for data, or in the same barrier), and the launcher would never see it fail.  So this runner
runs the script as ``__main__`` (as ``python SCRIPT`` does) and, when it ends with a non-zero
status after ``jax.distributed`` was initialised, leaves at once with that status, without the
barrier.  Uncaught exceptions are handled by the hook ``jaxpar.init`` installs (exit status 1).

It is started by path, so that importing it imports neither jaxpar nor JAX before the script
sets up its environment.
"""

from __future__ import annotations

import os
import runpy
import sys


def exit_status(code: object) -> int:
    """The process exit status Python gives ``SystemExit(code)``.

    >>> exit_status(None), exit_status(3), exit_status(True)
    (0, 3, 1)
    """
    if code is None:
        return 0
    if isinstance(code, int):
        return int(code) & 0xFF
    return 1  # sys.exit("message") prints the message and exits 1


def _distributed() -> bool:
    jax = sys.modules.get("jax")
    check = getattr(getattr(jax, "distributed", None), "is_initialized", None)
    try:
        return bool(check()) if check is not None else False
    except Exception:  # noqa: BLE001 - a half-torn-down JAX: no barrier to skip
        return False


def main(argv: list[str]) -> None:
    if not argv or argv[0] == "-m" and len(argv) < 2:
        sys.exit("usage: rank.py SCRIPT ARGS... | rank.py -m MODULE ARGS...")
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            sys.path[0] = os.getcwd()  # as python -m does
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as python SCRIPT does
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        status = exit_status(e.code)
        if status and _distributed():
            if not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
