"""``jaxpar k8s``: Kubeflow manifests that pass the CRD schema and the operator's rules, and
broken ones refused with a message that says what and where."""

import copy

import pytest
import yaml

from jaxpar._src.launch.cli import main
from jaxpar._src.launch.comm import cluster_env
from jaxpar._src.launch.k8s import ManifestError, jaxjob, trainjob, validate

CMD = ["python", "train.py", "--epochs", "3"]


def _container(m):
    return m["spec"]["jaxReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]


def _env(container):
    return {e["name"]: e["value"] for e in container["env"]}


@pytest.mark.parametrize("options", [
    dict(workers=1),
    dict(workers=2, devices_per_worker=4, cpu="4", memory="8Gi"),
    dict(workers=8, gpu=1, namespace="research", env=[("WANDB_MODE", "offline")]),
    dict(workers=4, cpu="500m", memory="2Gi", restart_policy="Never", clean_pod_policy="All"),
    dict(workers=16, devices_per_worker=2, gpu=None, backoff_limit=3),
])
def test_generated_jaxjobs_pass_schema_and_rules(options):
    m = jaxjob("digits-dp", "ghcr.io/me/train:1", CMD, **options)
    validate(m)
    assert m["apiVersion"] == "kubeflow.org/v1" and m["kind"] == "JAXJob"
    worker = m["spec"]["jaxReplicaSpecs"]["Worker"]
    assert worker["replicas"] == options["workers"]
    c = _container(m)
    assert c["name"] == "jax" and c["command"] == CMD
    env = _env(c)
    if options.get("gpu"):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert "JAX_PLATFORMS" not in env  # the pod uses its accelerator
    else:
        assert env["JAX_PLATFORMS"] == "cpu"
    if options.get("devices_per_worker") and not options.get("gpu"):
        assert env["JAX_NUM_CPU_DEVICES"] == str(options["devices_per_worker"])
    for key, value in options.get("env", ()):
        assert env[key] == value
    assert yaml.safe_load(yaml.safe_dump(m)) == m


def test_the_pods_join_through_init():
    """What the operator injects into pod 1 of 4 is what ``jaxpar.init`` reads."""
    injected = {"COORDINATOR_ADDRESS": "digits-dp-worker-0", "COORDINATOR_PORT": "6666",
                "NUM_PROCESSES": "4", "PROCESS_ID": "1"}
    env = cluster_env(injected)
    assert (env.coordinator, env.num_processes, env.process_id) == ("digits-dp-worker-0:6666",
                                                                    4, 1)
    m = jaxjob("digits-dp", "img", CMD, workers=4)
    assert _container(m)["ports"][0]["containerPort"] == 6666


def _broken(change):
    m = jaxjob("digits", "ghcr.io/me/train:1", CMD, workers=2, cpu="2")
    m = copy.deepcopy(m)
    change(m)
    return m


def _set(path, value):
    def change(m):
        node = m
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return change


W = ["spec", "jaxReplicaSpecs", "Worker"]
C = [*W, "template", "spec", "containers", 0]


@pytest.mark.parametrize("change, message", [
    (_set(["metadata", "name"], "Digits_Run"), "metadata.name: 'Digits_Run' is not a DNS-1035"),
    (_set(["metadata", "name"], "x" * 64), "at most 63 characters"),
    (_set(["metadata", "namespace"], "Team A"), "metadata.namespace: 'Team A'"),
    (_set(["apiVersion"], "kubeflow.org/v2"), "apiVersion: 'kubeflow.org/v1' was expected"),
    (_set([*W, "replicas"], "2"), "spec.jaxReplicaSpecs.Worker.replicas: '2' is not of type "
                                  "'integer'"),
    (_set([*W, "replicas"], 0), "0 workers; give at least 1"),
    (_set([*W, "restartPolicy"], "Sometimes"), "'Sometimes' is not one of"),
    (lambda m: m["spec"]["jaxReplicaSpecs"].update(Chief=m["spec"]["jaxReplicaSpecs"]["Worker"]),
     "replica type 'Chief' is not supported"),
    (_set([*C, "name"], "main"), "no container is named 'jax'"),
    (lambda m: _container(m).pop("image"), "containers[0]: no image"),
    (_set([*C, "command"], "python train.py"), "is not of type 'array'"),
    (_set([*C, "env"], [{"name": "1BAD", "value": "x"}]), "'1BAD' is not a valid environment"),
    (_set([*C, "ports"], [{"containerPort": 70000}]), "containerPort 70000 is not in 1-65535"),
    (_set(["spec", "runPolicy", "cleanPodPolicy"], "Some"), "cleanPodPolicy: 'Some'"),
    (_set([*C, "resources"], {"limits": {"cpu": "-3"}}), "cpu='-3' is not a positive Kubernetes"),
    (_set([*C, "resources"], {"requests": {"memory": "lots"}}), "memory='lots' is not a positive"),
    (lambda m: m["spec"].pop("jaxReplicaSpecs"), "'jaxReplicaSpecs' is a required property"),
])
def test_broken_manifests_are_rejected(change, message):
    with pytest.raises(ManifestError) as e:
        validate(_broken(change))
    assert message in str(e.value)
    assert "would be rejected" in str(e.value).splitlines()[0]


def test_every_problem_is_listed_at_once():
    def change(m):
        m["metadata"]["name"] = "Bad"
        _container(m)["name"] = "main"
    with pytest.raises(ManifestError) as e:
        validate(_broken(change))
    lines = [line for line in str(e.value).splitlines() if line.startswith("  - ")]
    assert len(lines) == 2


def test_trainer_v2_trainjob():
    m = trainjob("digits", "ghcr.io/me/train:1", CMD, workers=3, devices_per_worker=2,
                 cpu="2")
    validate(m)
    assert m["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert m["spec"]["runtimeRef"]["name"] == "jax-distributed"
    assert m["spec"]["trainer"]["numNodes"] == 3
    m["spec"]["trainer"]["numNodes"] = "three"
    with pytest.raises(ManifestError, match="numNodes"):
        validate(m)


def test_command_prints_valid_yaml(capsys):
    assert main(["k8s", "--name", "digits", "--image", "ghcr.io/me/train:1", "--workers", "2",
                 "--devices-per-worker", "4", "--cpu", "4", "--memory", "8Gi",
                 "--env", "SEED=1", "--", *CMD]) == 0
    m = yaml.safe_load(capsys.readouterr().out)
    validate(m)
    assert _container(m)["command"] == CMD
    assert _env(_container(m))["SEED"] == "1"

    assert main(["k8s", "--name", "digits", "--image", "img", "--workers", "2",
                 "--trainer-v2", "--", *CMD]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["kind"] == "TrainJob"


def test_command_refuses_what_the_cluster_would(capsys):
    assert main(["k8s", "--name", "Digits", "--image", "img", "--workers", "2", "--",
                 *CMD]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "metadata.name: 'Digits' is not a DNS-1035 label" in captured.err
    with pytest.raises(SystemExit):
        main(["k8s", "--name", "d", "--image", "img", "--workers", "2"])  # no command
    assert "give the pods' command after --" in capsys.readouterr().err
    assert main(["k8s", "--name", "d", "--image", "img", "--workers", "2", "--cpu", "-3", "--",
                 *CMD]) == 2
    assert "cpu='-3' is not a positive Kubernetes quantity" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["k8s", "--name", "d", "--image", "img", "--workers", "2",
              "--devices-per-worker", "0", "--", *CMD])
    assert "--devices-per-worker must be at least 1" in capsys.readouterr().err
