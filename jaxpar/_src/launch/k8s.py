"""``jaxpar k8s``: Kubeflow manifests whose pods train through ``jaxpar.init()``.

A ``JAXJob`` (``kubeflow.org/v1``, Kubeflow Training Operator, MindSpore's ms-operator
counterpart) runs ``--workers`` pods of one container named ``jax``; the operator injects
``COORDINATOR_ADDRESS``, ``COORDINATOR_PORT``, ``NUM_PROCESSES`` and ``PROCESS_ID``, which
:func:`jaxpar.init` reads.  ``--trainer-v2`` prints a Kubeflow Trainer v2 ``TrainJob`` on the
``jax-distributed`` runtime instead (it injects ``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``).

Every manifest is validated before it is printed, offline: against the CRD schema (a subset of
the published schema, kept in ``schemas/`` with its source named) with ``jsonschema``, and
against the operator's own rules (its admission webhook): DNS-1035 names, the only replica type
``Worker``, a container named ``jax``, an image on every container.

>>> m = jaxjob("digits", "ghcr.io/me/train:1", ["python", "train.py"], workers=2)
>>> m["spec"]["jaxReplicaSpecs"]["Worker"]["replicas"]
2
>>> validate(m)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from jaxpar._src.errors import JaxparError

JAX_PORT = 6666  # the operator's default "jaxjob-port"
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
CLEAN_POD_POLICIES = ("All", "Running", "None")
SCHEMAS = os.path.join(os.path.dirname(__file__), "schemas")


class ManifestError(JaxparError):
    """A manifest the Kubernetes API server or the operator would reject."""


def jaxjob(name: str, image: str, command: Sequence[str], *, workers: int,
           devices_per_worker: int | None = None, cpu: str | None = None,
           memory: str | None = None, gpu: int | None = None, namespace: str | None = None,
           env: Sequence[tuple[str, str]] = (), restart_policy: str = "OnFailure",
           clean_pod_policy: str = "None", backoff_limit: int = 0) -> dict[str, Any]:
    """A ``JAXJob`` manifest (a dict; :func:`to_yaml` prints it)."""
    container: dict[str, Any] = {
        "name": "jax",
        "image": image,
        "command": list(command),
        "env": _env(env, devices_per_worker, gpu),
        "ports": [{"name": "jaxjob-port", "containerPort": JAX_PORT}],
    }
    resources = _resources(cpu, memory, gpu)
    if resources:
        container["resources"] = resources
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "JAXJob",
        "metadata": _metadata(name, namespace),
        "spec": {
            "runPolicy": {"cleanPodPolicy": clean_pod_policy, "backoffLimit": backoff_limit},
            "jaxReplicaSpecs": {"Worker": {
                "replicas": workers,
                "restartPolicy": restart_policy,
                "template": {"spec": {"containers": [container]}},
            }},
        },
    }


def trainjob(name: str, image: str, command: Sequence[str], *, workers: int,
             devices_per_worker: int | None = None, cpu: str | None = None,
             memory: str | None = None, gpu: int | None = None, namespace: str | None = None,
             env: Sequence[tuple[str, str]] = (), runtime: str = "jax-distributed"
             ) -> dict[str, Any]:
    """A Kubeflow Trainer v2 ``TrainJob`` on the ``jax-distributed`` runtime."""
    trainer: dict[str, Any] = {"image": image, "command": list(command), "numNodes": workers,
                               "env": _env(env, devices_per_worker, gpu)}
    resources = _resources(cpu, memory, gpu)
    if resources:
        trainer["resourcesPerNode"] = resources
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": _metadata(name, namespace),
            "spec": {"runtimeRef": {"name": runtime}, "trainer": trainer}}


def _metadata(name: str, namespace: str | None) -> dict[str, str]:
    return {"name": name, **({"namespace": namespace} if namespace else {})}


def _env(extra: Sequence[tuple[str, str]], devices: int | None, gpu: int | None
         ) -> list[dict[str, str]]:
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    if not gpu:
        env.append({"name": "JAX_PLATFORMS", "value": "cpu"})
        if devices:
            env.append({"name": "JAX_NUM_CPU_DEVICES", "value": str(devices)})
    env += [{"name": k, "value": str(v)} for k, v in extra]
    return env


def _resources(cpu: str | None, memory: str | None, gpu: int | None) -> dict[str, Any]:
    limits: dict[str, Any] = {}
    if cpu:
        limits["cpu"] = cpu
    if memory:
        limits["memory"] = memory
    if gpu:
        limits["nvidia.com/gpu"] = gpu
    return {"limits": limits, "requests": dict(limits)} if limits else {}


# -- validation -------------------------------------------------------------------------------
def validate(manifest: dict[str, Any]) -> None:
    """Raises :class:`ManifestError` listing every problem, or returns ``None``."""
    kind = str(manifest.get("kind"))
    schema_file = {"JAXJob": "jaxjob.schema.json", "TrainJob": "trainjob.schema.json"}.get(kind)
    if schema_file is None:
        raise ManifestError(f"jaxpar k8s: kind {kind!r} is not JAXJob or TrainJob.")
    problems = _schema_problems(manifest, schema_file)
    problems += _jaxjob_rules(manifest) if kind == "JAXJob" else _trainjob_rules(manifest)
    if problems:
        name = manifest.get("metadata", {}).get("name", "?")
        raise ManifestError(f"jaxpar k8s: {kind} {name!r} would be rejected:\n" +
                            "\n".join(f"  - {p}" for p in problems))


def _schema_problems(manifest: dict[str, Any], schema_file: str) -> list[str]:
    try:
        import jsonschema
    except ImportError:
        raise ManifestError("jaxpar k8s: validating manifests needs jsonschema (pip install "
                            "'jaxpar[k8s]').") from None
    with open(os.path.join(SCHEMAS, schema_file)) as f:
        schema = json.load(f)
    validator = jsonschema.Draft7Validator(schema)
    out = []
    for error in sorted(validator.iter_errors(manifest), key=lambda e: list(e.path)):
        where = ".".join(str(p) for p in error.path) or "(top level)"
        out.append(f"{where}: {error.message}")
    return out


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return spec.get("template", {}).get("spec", {}).get("containers", []) or []


def _jaxjob_rules(m: dict[str, Any]) -> list[str]:
    """The Training Operator's admission webhook (``jaxjob_webhook.go``) and its defaults."""
    out = _name_rules(m)
    replicas = m.get("spec", {}).get("jaxReplicaSpecs", {})
    if isinstance(replicas, dict):
        for key in replicas:
            if key != "Worker":
                out.append(f"spec.jaxReplicaSpecs: replica type {key!r} is not supported; "
                           f"JAXJob has only 'Worker'")
        worker = replicas.get("Worker")
        if isinstance(worker, dict):
            n = worker.get("replicas", 1)
            if isinstance(n, int) and n < 1:
                out.append(f"spec.jaxReplicaSpecs.Worker.replicas: {n} workers; give at least 1")
            policy = worker.get("restartPolicy")
            if policy is not None and policy not in RESTART_POLICIES:
                out.append(f"spec.jaxReplicaSpecs.Worker.restartPolicy: {policy!r} is not one "
                           f"of {list(RESTART_POLICIES)}")
            containers = _containers(worker)
            if not any(c.get("name") == "jax" for c in containers):
                out.append("spec.jaxReplicaSpecs.Worker: no container is named 'jax' (the "
                           "operator runs and configures that one)")
            for i, c in enumerate(containers):
                if not c.get("image"):
                    out.append(f"spec.jaxReplicaSpecs.Worker.template.spec.containers[{i}]: "
                               f"no image")
                out += _container_rules(c, f"containers[{i}]")
    clean = m.get("spec", {}).get("runPolicy", {}).get("cleanPodPolicy")
    if clean is not None and clean not in CLEAN_POD_POLICIES:
        out.append(f"spec.runPolicy.cleanPodPolicy: {clean!r} is not one of "
                   f"{list(CLEAN_POD_POLICIES)}")
    return out


def _trainjob_rules(m: dict[str, Any]) -> list[str]:
    out = _name_rules(m)
    trainer = m.get("spec", {}).get("trainer", {})
    if isinstance(trainer, dict):
        out += _container_rules(trainer, "spec.trainer")
    return out


def _name_rules(m: dict[str, Any]) -> list[str]:
    out = []
    meta = m.get("metadata", {})
    name = meta.get("name") if isinstance(meta, dict) else None
    if isinstance(name, str) and (len(name) > 63 or not DNS1035.match(name)):
        out.append(f"metadata.name: {name!r} is not a DNS-1035 label (lower-case letters, digits "
                   f"and '-', starting with a letter, at most 63 characters)")
    namespace = meta.get("namespace") if isinstance(meta, dict) else None
    if isinstance(namespace, str) and (len(namespace) > 63 or not DNS1123.match(namespace)):
        out.append(f"metadata.namespace: {namespace!r} is not a DNS-1123 label")
    return out


def _container_rules(c: dict[str, Any], where: str) -> list[str]:
    out = []
    resources = c.get("resources", c.get("resourcesPerNode"))
    for part in ("limits", "requests"):
        amounts = resources.get(part) if isinstance(resources, dict) else None
        for name, value in (amounts or {}).items():
            if not _positive_quantity(value):
                out.append(f"{where}.resources.{part}: {name}={value!r} is not a positive "
                           f"Kubernetes quantity (e.g. cpu 4 or 500m, memory 16Gi)")
    for e in c.get("env", []) or []:
        if isinstance(e, dict) and isinstance(e.get("name"), str) and \
                not ENV_NAME.match(e["name"]):
            out.append(f"{where}.env: {e['name']!r} is not a valid environment variable name")
    for p in c.get("ports", []) or []:
        port = p.get("containerPort") if isinstance(p, dict) else None
        if isinstance(port, int) and not 0 < port < 65536:
            out.append(f"{where}.ports: containerPort {port} is not in 1-65535")
    return out


QUANTITY = re.compile(r"^\+?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+|[KMGTPE]i|[mkMGTPE])?$")


def _positive_quantity(value: Any) -> bool:
    """A Kubernetes resource quantity above zero: ``4``, ``0.5``, ``500m``, ``16Gi``.

    >>> [_positive_quantity(q) for q in ("4", "500m", "16Gi", 2, "-3", "0", "4 cores")]
    [True, True, True, True, False, False, False]
    """
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return value > 0
    match = QUANTITY.match(value) if isinstance(value, str) else None
    return match is not None and float(match.group(1)) > 0


def to_yaml(manifest: dict[str, Any]) -> str:
    try:
        import yaml
    except ImportError:
        raise ManifestError("jaxpar k8s: printing YAML needs PyYAML (pip install "
                            "'jaxpar[k8s]').") from None
    return yaml.safe_dump(copy.deepcopy(manifest), sort_keys=False)


# -- the command ------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", required=True, help="the job's name (a DNS-1035 label)")
    p.add_argument("--image", required=True, help="container image with jaxpar and the script")
    p.add_argument("--workers", type=int, required=True, help="pods (one JAX process each)")
    p.add_argument("--devices-per-worker", type=int, default=None,
                   help="devices each pod drives (CPU: emulated devices)")
    p.add_argument("--cpu", default=None, help="CPU per pod, e.g. 4")
    p.add_argument("--memory", default=None, help="memory per pod, e.g. 16Gi")
    p.add_argument("--gpu", type=int, default=None, help="NVIDIA GPUs per pod")
    p.add_argument("--namespace", default=None)
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment variables (repeatable)")
    p.add_argument("--restart-policy", default="OnFailure", choices=RESTART_POLICIES)
    p.add_argument("--trainer-v2", action="store_true",
                   help="print a Kubeflow Trainer v2 TrainJob instead of a JAXJob")
    p.add_argument("cmd", nargs=argparse.REMAINDER,
                   help="after --: the command each pod runs, e.g. -- python train.py")


def command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        parser.error("give the pods' command after --, e.g. -- python train.py")
    env = []
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--env takes KEY=VALUE, got {item!r}")
        env.append((key, value))
    for flag, value in (("--workers", args.workers), ("--devices-per-worker",
                                                       args.devices_per_worker)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.gpu is not None and args.gpu < 0:
        parser.error(f"--gpu must be 0 or more, got {args.gpu}")
    build = trainjob if args.trainer_v2 else jaxjob
    options = dict(workers=args.workers, devices_per_worker=args.devices_per_worker,
                   cpu=args.cpu, memory=args.memory, gpu=args.gpu, namespace=args.namespace,
                   env=env)
    if not args.trainer_v2:
        options["restart_policy"] = args.restart_policy
    manifest = build(args.name, args.image, cmd, **options)
    try:
        validate(manifest)
    except ManifestError as e:
        print(str(e), file=sys.stderr)
        return 2
    sys.stdout.write(to_yaml(manifest))
    return 0
