"""Kubernetes backend: every manifest validated against the official schema (strict), their
semantics the schema cannot check, the hardening of every container, the labels the backend owns,
and the settings it refuses (no cluster here)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from test_kubernetes import CONTEXT, config, validate

from airflow_elastic_gpu.backends.base import BackendError
from airflow_elastic_gpu.backends.kubernetes import (
    LABEL_GENERATION,
    LABEL_JOB,
    LABEL_MANAGED_BY,
    KubernetesJobConfig,
    PodBuilder,
    to_dict,
)

TEMPLATE = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {"labels": {"team": "vision"}},
    "spec": {"priorityClassName": "batch", "containers": [{"name": "base", "image": "ignored"}],
             "nodeSelector": {"pool": "a100"}},
}


@pytest.mark.parametrize("kind", ["inplace", "recreate", "template_file", "full_pod_spec", "knobs", "own_users"])
def test_every_manifest_validates_strictly_against_the_kubernetes_schema(tmp_path, kind):
    extra: dict = {}
    if kind == "recreate":
        extra = {"resize_mechanism": "recreate"}
    elif kind == "template_file":
        path = tmp_path / "pod.yaml"
        path.write_text(yaml.safe_dump(TEMPLATE))
        extra = {"pod_template_file": str(path)}
    elif kind == "full_pod_spec":
        extra = {"full_pod_spec": TEMPLATE}
    elif kind == "knobs":
        extra = {"image_pull_secrets": ("regcred",), "tolerations": ({"key": "gpu", "operator": "Exists",
                                                                    "effect": "NoSchedule"},),
                 "volumes": ({"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}},),
                 "volume_mounts": ({"name": "ckpt", "mountPath": "/ckpt"},),
                 "container_resources": {"requests": {"cpu": "4", "memory": "16Gi"}},
                 "service_account_name": "trainer", "labels": {"team": "nlp"},
                 "automount_service_account_token": True}
    elif kind == "own_users":  # the images' own users, and a profiler's capability for the trainer
        extra = {"run_as_user": None, "run_as_group": None,
                 "trainer_security_context": {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                              "capabilities": {"drop": ["ALL"], "add": ["SYS_PTRACE"]}}}
    builder = PodBuilder(config(**extra))
    pod = to_dict(builder.pod("3f1c-job", "python train.py --gpus {num_gpus}", "gpu-node-7", 2,
                              progress_pattern=r"step (?P<step>\d+)", checkpoint_dir="/ckpt/run1",
                              env={"WANDB_MODE": "offline"}, context=CONTEXT))
    validate(pod)
    validate(to_dict(builder.secret("3f1c-job", "tok")))
    if kind in ("template_file", "full_pod_spec"):
        assert pod["spec"]["priorityClassName"] == "batch" and pod["spec"]["nodeSelector"] == {"pool": "a100"}
        assert pod["metadata"]["labels"]["team"] == "vision"


def test_the_schema_check_is_strict():
    with pytest.raises(kubernetes_validate.ValidationError):
        validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
                  "spec": {"containers": [{"name": "c", "image": "i", "restartPolicyy": "Always"}]}})


def test_pod_semantics_the_schema_cannot_check():
    pod = to_dict(PodBuilder(config()).pod("job-1", "python train.py", "gpu-node-7", 3, context=CONTEXT))
    spec = pod["spec"]
    copy_init, agent = spec["initContainers"]
    (trainer,) = spec["containers"]
    assert agent["name"] == "elastic-agent" and agent["restartPolicy"] == "Always"  # native sidecar
    assert "restartPolicy" not in copy_init  # a plain init container runs to completion first
    assert "nodeName" not in spec and spec["restartPolicy"] == "Never"  # scheduled, not bound past the scheduler
    assert spec["affinity"] == {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-node-7"]}]}]}}}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["runtimeClassName"] == "nvidia"
    # GPUs come from the broker, not the device plugin's requests
    assert all("nvidia.com/gpu" not in str(c.get("resources")) for c in (copy_init, agent, trainer))
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in trainer["env"]
    for c in (copy_init, agent, trainer):  # the shared volume is in every container
        assert {"name": "elastic", "mountPath": "/elastic"} in c["volumeMounts"]
    assert {"name": "elastic", "emptyDir": {}} in spec["volumes"]
    assert "env" not in agent  # the token is a file of the job's Secret, mounted into the agent only
    assert {"name": "elastic-token", "mountPath": "/var/run/secrets/elastic-gpu", "readOnly": True} \
        in agent["volumeMounts"]
    (token_volume,) = [v for v in spec["volumes"] if v["name"] == "elastic-token"]
    assert token_volume["secret"] == {"secretName": "elastic-gpu-token-job-1", "defaultMode": 0o440}
    assert agent["args"][agent["args"].index("--token-file") + 1] == "/var/run/secrets/elastic-gpu/token"
    assert all(m["name"] != "elastic-token" for c in (copy_init, trainer) for m in c["volumeMounts"])
    assert "--broker-api" in agent["args"] and "--broker-url" not in agent["args"]  # no DB password in pods
    assert trainer["command"] == ["python3", "/elastic/launcher.py"]
    assert trainer["args"][-2:] == ["--", "python train.py"]
    assert "--echo" in trainer["args"]  # kubectl logs shows the trainer's output
    assert "--pod-generation" not in agent["args"]  # in place: the agent applies every generation
    labels, notes = pod["metadata"]["labels"], pod["metadata"]["annotations"]
    assert labels[LABEL_JOB] == "job-1" and labels[LABEL_GENERATION] == "3"
    assert labels["elastic-gpu.airflow.apache.org/dag_id"] == "nightly_retraining"
    assert notes["elastic-gpu.airflow.apache.org/run_id"] == CONTEXT["run_id"]  # not label-safe: annotation
    assert pod["metadata"]["name"] == "elastic-gpu-job-1-g3"


def test_an_unmapped_tasks_map_index_label_differs_from_map_index_1():
    """``-1`` made a label value stripped of its ``-``: ``1``, the label of the mapped task's index 1."""
    labels = [PodBuilder(config()).pod("job-1", "python train.py", "n", 1,
                                       context={**CONTEXT, "map_index": index}).metadata.labels
              for index in ("-1", "1")]
    assert [x["elastic-gpu.airflow.apache.org/map_index"] for x in labels] == ["none", "1"]


def test_the_backends_own_containers_have_requests_and_limits():
    """A namespace with a compute ResourceQuota refuses a pod with a container without limits: the
    copy-launcher init container had no resources, the agent requests only."""
    pod = to_dict(PodBuilder(config()).pod("job-1", "python train.py", "gpu-node-7", 1))
    for sidecar in pod["spec"]["initContainers"]:
        resources = sidecar["resources"]
        assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}


RESTRICTED = {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
              "seccompProfile": {"type": "RuntimeDefault"}}


def test_every_container_is_hardened_and_no_service_account_token_is_mounted():
    pod = to_dict(PodBuilder(config()).pod("job-1", "python train.py", "gpu-node-7", 1))
    spec = pod["spec"]
    copy_init, agent = spec["initContainers"]
    (trainer,) = spec["containers"]
    for sidecar in (copy_init, agent):  # the backend's own images: read-only root as well
        assert sidecar["securityContext"] == {**RESTRICTED, "readOnlyRootFilesystem": True}
    assert trainer["securityContext"] == RESTRICTED  # the user's image may write to its filesystem
    assert spec["automountServiceAccountToken"] is False
    # one non-root user in every container: the agent and the launcher share files of mode 0600
    assert spec["securityContext"] == {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                                       "fsGroupChangePolicy": "OnRootMismatch",
                                       "seccompProfile": {"type": "RuntimeDefault"}}


def test_the_trainers_security_context_and_user_can_be_overridden():
    custom = {"runAsNonRoot": True, "capabilities": {"drop": ["ALL"], "add": ["SYS_PTRACE"]}}
    pod = to_dict(PodBuilder(config(trainer_security_context=custom, run_as_user=None, run_as_group=None,
                                    automount_service_account_token=True)).pod("j", "x", "n", 1))
    (trainer,) = pod["spec"]["containers"]
    assert trainer["securityContext"] == custom  # replaces the default, is not merged with it
    assert pod["spec"]["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["spec"]["automountServiceAccountToken"] is True
    token_volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "elastic-token")
    assert token_volume["secret"]["defaultMode"] == 0o444  # no fsGroup: readable by the agent's own user
    assert pod["spec"]["initContainers"][1]["securityContext"]["runAsNonRoot"] is True  # the agent stays hardened
    bare = to_dict(PodBuilder(config(trainer_security_context={})).pod("j", "x", "n", 1))
    assert "securityContext" not in bare["spec"]["containers"][0]


@pytest.mark.parametrize("key", [LABEL_JOB, LABEL_GENERATION, LABEL_MANAGED_BY,
                                 "elastic-gpu.airflow.apache.org/dag_id"])
@pytest.mark.parametrize("field", ["labels", "annotations"])
def test_the_backends_own_labels_cannot_be_set_by_the_user(key, field):
    with pytest.raises(BackendError, match=rf"{field}: '{key}' is set by airflow-elastic-gpu"):
        config(**{field: {key: "other-job"}})


@pytest.mark.parametrize("source", ["pod_template_file", "full_pod_spec"])
def test_a_pod_template_cannot_overwrite_the_backends_own_labels(tmp_path, source):
    template = copy.deepcopy(TEMPLATE)
    template["metadata"]["labels"].update({LABEL_JOB: "other-job", LABEL_GENERATION: "99",
                                           LABEL_MANAGED_BY: "someone-else"})
    template["metadata"]["annotations"] = {LABEL_JOB: "other-job"}
    if source == "pod_template_file":
        path = tmp_path / "pod.yaml"
        path.write_text(yaml.safe_dump(template))
        extra = {"pod_template_file": str(path)}
    else:
        extra = {"full_pod_spec": template}
    pod = to_dict(PodBuilder(config(**extra)).pod("job-1", "python train.py", "gpu-node-7", 3))
    labels = pod["metadata"]["labels"]
    assert labels[LABEL_JOB] == "job-1" and labels[LABEL_GENERATION] == "3"
    assert labels[LABEL_MANAGED_BY] == "airflow-elastic-gpu" and labels["team"] == "vision"
    assert pod["metadata"]["annotations"][LABEL_JOB] == "job-1"


def test_a_pod_template_is_held_to_the_settings_own_checks():
    """A usual GPU template (KubernetesPodOperator's) asks the device plugin for GPUs and mounts the
    service account token: merged by position into the trainer, its GPU request made the device
    plugin hand out GPUs beside the broker's, and its token was mounted (the merge reads the
    generated ``False`` as unset). The request is refused, the token is not mounted."""
    template = copy.deepcopy(TEMPLATE)
    template["spec"]["automountServiceAccountToken"] = True
    pod = to_dict(PodBuilder(config(full_pod_spec=template)).pod("job-1", "python train.py", "gpu-node-7", 3))
    assert pod["spec"]["automountServiceAccountToken"] is False
    template["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 8}}
    with pytest.raises(BackendError, match="the pod template's container 'trainer' requests nvidia.com/gpu"):
        PodBuilder(config(full_pod_spec=template)).pod("job-1", "python train.py", "gpu-node-7", 3)
    template = copy.deepcopy(TEMPLATE)
    template["spec"]["volumes"] = [{"name": "elastic-token", "emptyDir": {}}]
    with pytest.raises(BackendError, match="a volume named 'elastic-token', the backend's own"):
        PodBuilder(config(full_pod_spec=template)).pod("job-1", "python train.py", "gpu-node-7", 3)


def test_building_a_pod_without_a_template_does_not_import_airflow():
    code = (
        "import sys\n"
        "sys.modules['airflow'] = None  # any import of Airflow now fails\n"
        "from airflow_elastic_gpu.backends.kubernetes import KubernetesJobConfig, PodBuilder\n"
        "pod = PodBuilder(KubernetesJobConfig(image='i')).pod('job-1', 'python train.py', 'node', 1)\n"
        "from airflow_elastic_gpu.backends.kubernetes_pods import pod_node\n"
        "assert pod_node(pod) == 'node' and pod.spec.node_name is None\n"
        "assert not [m for m in sys.modules if m.startswith('airflow.')]\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize(("kw", "message"), [
    ({"image": ""}, "needs an image"),
    ({"resize_mechanism": "migrate"}, "resize_mechanism must be one of"),
    ({"on_finish_action": "explode"}, "on_finish_action must be one of"),
    ({"broker_api_url": "broker:8793"}, "must start with http"),
    ({"container_resources": {"limits": {"nvidia.com/gpu": 1}}}, "do not request nvidia.com/gpu"),
    ({"namespace": "Bad_NS!"}, "namespace must be a DNS-1123 label"),
    ({"namespace": "a" * 64}, "namespace must be a DNS-1123 label"),
    ({"startup_grace_s": -1}, "startup_grace_s must be a number of seconds >= 0"),
    ({"startup_grace_s": float("nan")}, "startup_grace_s must be a number of seconds >= 0"),
    ({"startup_grace_s": "120"}, "startup_grace_s must be a number of seconds >= 0"),
    ({"volumes": "abc"}, "volumes must be a list of dicts"),
    ({"volumes": ["abc"]}, "volumes must be a list of dicts"),
    ({"volume_mounts": {"name": "x"}}, "volume_mounts must be a list of dicts"),
    ({"tolerations": "gpu"}, "tolerations must be a list of dicts"),
    ({"volumes": [{"name": "elastic", "emptyDir": {}}]}, "'elastic' is the backend's own"),
    # the Python client's snake_case was dropped without a word: the checkpoint volume an empty directory
    ({"volumes": [{"name": "ckpt", "persistent_volume_claim": {"claim_name": "ckpt"}}]},
     r"volumes\[0\]: unknown field 'persistent_volume_claim' of a Volume"),
    ({"volumes": [{"name": "ckpt"}]}, "volumes: 'ckpt' has no source"),
    ({"volume_mounts": [{"name": "ckpt", "mount_path": "/ckpt"}]}, r"volume_mounts\[0\]: not a valid VolumeMount"),
    ({"volume_mounts": [{"name": "ckpt", "mountPath": "/ckpt", "readonly": True}]},
     r"volume_mounts\[0\]: unknown field 'readonly'"),
    ({"tolerations": [{"key": "gpu", "efect": "NoSchedule"}]}, r"tolerations\[0\]: unknown field 'efect'"),
    ({"image_pull_secrets": "regcred"}, "image_pull_secrets must be a list of Secret names"),
    ({"labels": "team=nlp"}, "labels must be a dict of strings"),
    ({"labels": {"team": "NLP team!"}}, r"labels\['team'\]: 'NLP team!' is not a valid label value"),
    ({"labels": {"bad key": "x"}}, "labels: 'bad key' is not a valid key"),
    ({"annotations": {"note": 3}}, "annotations must be a dict of strings"),
    ({"run_as_user": 0}, "run_as_user must be an integer >= 1"),
    ({"trainer_security_context": "restricted"}, "trainer_security_context must be a dict"),
    # misspelt fields were dropped without a word: no limits at all, or the hardened default gone
    ({"container_resources": {"limit": {"cpu": "8"}}},
     r"container_resources: unknown field 'limit' of a ResourceRequirements .*known there: claims, limits, requests"),
    ({"trainer_security_context": {"runAsUSer": 0}},
     r"trainer_security_context: unknown field 'runAsUSer' of a SecurityContext .*runAsNonRoot, runAsUser"),
    ({"trainer_security_context": {"capabilities": {"ad": ["SYS_PTRACE"]}}},
     r"unknown field 'capabilities.ad' of a SecurityContext .*known there: add, drop\)"),
    ({"automount_service_account_token": "no"}, "automount_service_account_token must be True or False"),
])
def test_bad_kubernetes_settings_are_rejected(kw, message):
    args = {"image": "train:1", **kw}
    with pytest.raises(BackendError, match=message):
        KubernetesJobConfig(**args)


# --------------------------------------------------------------------------- fake API


def test_config_round_trips_through_the_trigger_kwargs():
    c = config(tolerations=({"key": "gpu", "operator": "Exists"},), image_pull_secrets=("regcred",))
    assert KubernetesJobConfig.from_dict(c.to_dict()) == c


def test_the_command_pattern_and_env_reach_the_container_as_written():
    """No shell runs the command (the launcher splits it with shlex), so ``$`` is the user's own
    character on every backend; Kubernetes would make ``run$$`` ``run$`` and expand ``$(NAME)``
    (as the podman harness does, for podman 4.3 does not)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "containers"))
    from podman_core import kubelet_expand as kubelet_expands
    command = "python train.py --tag run$$ --devices $(NVIDIA_VISIBLE_DEVICES) --cost 5$"
    env = {"GREETING": "a$(NVIDIA_VISIBLE_DEVICES)b$$c"}
    pod = to_dict(PodBuilder(config()).pod("job-1", command, "n", 1, progress_pattern=r"step (\d+)$",
                                           checkpoint_dir="/ckpt/$(USER)", env=env, context=CONTEXT))
    _copy_init, agent = pod["spec"]["initContainers"]
    (trainer,) = pod["spec"]["containers"]
    environ = {e["name"]: kubelet_expands(e["value"], {}) for e in trainer["env"]}
    assert environ["GREETING"] == env["GREETING"]
    args = [kubelet_expands(a, environ) for a in trainer["args"]]
    assert args[-1] == command and args[args.index("--checkpoint-dir") + 1] == "/ckpt/$(USER)"
    agent_args = [kubelet_expands(a, {}) for a in agent["args"]]
    assert agent_args[agent_args.index("--progress-pattern") + 1] == r"step (\d+)$"


def test_a_pod_templates_tolerations_and_affinity_are_kept_with_the_pin_to_the_node():
    """The generated tolerations (the GPU taint's) and node affinity replaced the template's whole
    list and affinity: the template's toleration of a dedicated node pool's taint was lost, and the
    pod, now scheduled, stayed Pending. Its required terms are narrowed to the broker's node."""
    from airflow_elastic_gpu.backends.kubernetes_pods import pod_node

    template = copy.deepcopy(TEMPLATE)
    template["spec"]["tolerations"] = [{"key": "dedicated", "value": "training", "effect": "NoSchedule"}]
    zone = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a", "b"]}
    anti = {"labelSelector": {"matchLabels": {"team": "vision"}}, "topologyKey": "kubernetes.io/hostname"}
    template["spec"]["affinity"] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [zone]}]}},
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 10, "podAffinityTerm": anti}]}}
    built = PodBuilder(config(full_pod_spec=template)).pod("job-1", "python train.py", "gpu-node-7", 3)
    pod = to_dict(built)
    validate(pod)
    assert pod["spec"]["tolerations"] == [template["spec"]["tolerations"][0], {
        "key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    (term,) = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert term == {"matchExpressions": [zone],
                    "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-node-7"]}]}
    assert pod["spec"]["affinity"]["podAntiAffinity"] == template["spec"]["affinity"]["podAntiAffinity"]
    assert pod_node(built) == "gpu-node-7"


def test_a_template_of_metadata_only_builds_a_pod():
    """A template with labels or annotations only (no ``spec``: valid for KubernetesPodOperator)
    crashed every pod build with ``AttributeError: 'NoneType' object has no attribute 'tolerations'``."""
    template = {"apiVersion": "v1", "kind": "Pod", "metadata": {"labels": {"team": "vision"}}}
    pod = to_dict(PodBuilder(config(full_pod_spec=template)).pod("job-1", "python train.py", "gpu-node-0", 1))
    validate(pod)
    assert pod["metadata"]["labels"]["team"] == "vision"


def test_a_template_file_is_read_where_the_task_runs_and_a_missing_one_is_named(tmp_path):
    """Airflow's pod generator only warns about a missing template file and builds the pod without
    it (a misspelt path, or a triggerer without the worker's file: it builds the pods of every
    resize by re-creation, move and gang growth); the operator now reads the file on the worker and
    hands the trigger its contents."""
    from airflow_elastic_gpu.backends.kubernetes_config import with_pod_template_read
    from airflow_elastic_gpu.operators.training import ElasticTrainingOperator

    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(TEMPLATE))
    builder = PodBuilder(config(pod_template_file=str(path)))
    settings = {"namespace": "ml", "pod_template_file": str(path), "broker_api_url": "http://broker:8080"}
    op = ElasticTrainingOperator(task_id="train", command="python train.py", total_steps=10, backend="kubernetes",
                                 image="train:1", kubernetes=settings)
    carried = op._trigger_kwargs(job_id="job-1", labels=CONTEXT)["kubernetes"]
    assert carried["full_pod_spec"] == TEMPLATE and carried["pod_template_file"] is None
    path.unlink()  # the triggerer has no such file
    pod = to_dict(PodBuilder(KubernetesJobConfig.from_dict(carried)).pod("job-1", "python train.py", "gpu-node-1", 2))
    validate(pod)
    assert pod["spec"]["priorityClassName"] == "batch"
    with pytest.raises(BackendError, match=r"pod_template_file '.*gpu.yaml' cannot be read on host"):
        builder.pod("job-1", "python train.py", "gpu-node-1", 2)
    with pytest.raises(BackendError, match="cannot be read"):
        with_pod_template_read(settings)
    path.write_text("- a list\n")
    with pytest.raises(BackendError, match="holds no pod"):
        builder.pod("job-1", "python train.py", "gpu-node-1", 2)
