"""The ``jaxpar`` command: ``jaxpar run`` (launcher) and ``jaxpar k8s`` (manifests).

``jaxpar plan`` plans a function and writes its HTML report (``jaxpar/_src/report/command.py``).

Also reachable as ``python -m jaxpar ...``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jaxpar._src.launch.launcher import LaunchConfig, launch, script_command


def _run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="start the processes of a multi-process job on this host",
        description="Start N processes of SCRIPT on this host under jax.distributed "
                    "(call jaxpar.init() in it). Example: jaxpar run -n 4 "
                    "--devices-per-process 2 train.py --epochs 3")
    p.add_argument("-n", "--nproc", type=int, required=True, help="processes on this host")
    p.add_argument("--devices-per-process", type=int, default=None,
                   help="devices each process drives (CPU: emulated devices)")
    p.add_argument("--log-dir", default="logs", help="where worker_<rank>.log files go")
    p.add_argument("--timeout", type=float, default=None, help="seconds before everything is "
                   "stopped")
    p.add_argument("--nnodes", type=int, default=1, help="hosts in the job")
    p.add_argument("--node-rank", type=int, default=0, help="this host's index (0..nnodes-1)")
    p.add_argument("--master-addr", default="127.0.0.1", help="the first host's address")
    p.add_argument("--master-port", type=int, default=None,
                   help="the coordinator's port (default: a free one on one host, 8118 on "
                        "several)")
    p.add_argument("script", help="the Python script (or -m and a module)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")


def _k8s_parser(sub: argparse._SubParsersAction) -> None:
    from jaxpar._src.launch.k8s import add_arguments

    p = sub.add_parser(
        "k8s", help="print a Kubeflow JAXJob (or TrainJob) manifest for a training command",
        description="Print a Kubeflow JAXJob manifest (kubeflow.org/v1) whose pods start the "
                    "command; validated against the CRD schema and the operator's rules. "
                    "Example: jaxpar k8s --name digits --image ghcr.io/me/train:1 --workers 2 "
                    "-- python train.py")
    add_arguments(p)


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    from jaxpar._src.report.command import add_arguments

    p = sub.add_parser(
        "plan", help="plan a function, print its table and write its HTML report",
        description="Plan FUNCTION (module:function or file.py:function) on a mesh, print the "
                    "plan's table and the compiled program's collectives with their causes, "
                    "and write the HTML report. Example: jaxpar plan model.py:train_step "
                    "--mesh 2x4 --builder model.py:make_args --html plan.html")
    add_arguments(p)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxpar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    _k8s_parser(sub)
    _plan_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "run":
        return _run(parser, args)
    if args.command == "plan":
        from jaxpar._src.report.command import command as plan_command

        return plan_command(args)
    from jaxpar._src.launch.k8s import command

    return command(parser, args)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.nproc < 1:
        parser.error("-n must be at least 1")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        parser.error("--devices-per-process must be at least 1")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank must be in [0, {args.nnodes})")
    if args.nnodes > 1 and args.master_addr in ("127.0.0.1", "localhost"):
        parser.error("several hosts need --master-addr: the address of the host with "
                     "--node-rank 0, reachable from every host")
    config = LaunchConfig(
        nproc=args.nproc, command=script_command(args.script, args.args),
        devices_per_process=args.devices_per_process, log_dir=args.log_dir,
        timeout=args.timeout, nnodes=args.nnodes, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port)
    return launch(config)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
