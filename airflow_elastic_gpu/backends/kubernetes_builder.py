"""The manifests of a Kubernetes job: its token Secret and its pod (:class:`PodBuilder`, pure: no
API calls); the layout is described in :mod:`.kubernetes` and ``docs/kubernetes.md``."""

from __future__ import annotations

import copy
from collections.abc import Mapping

from kubernetes.client import models as k8s

from airflow_elastic_gpu.backends.kubernetes_config import (
    JOB_DIR,
    LABEL_GENERATION,
    LABEL_JOB,
    LABEL_MANAGED_BY,
    LABEL_PREFIX,
    MANAGED_BY,
    SHARED,
    TOKEN_DIR,
    TOKEN_KEY,
    KubernetesJobConfig,
    checked_merge,
    context_label,
    hardened_security_context,
    label_value,
    model,
    read_pod_template,
    resource_name,
)
from airflow_elastic_gpu.backends.kubernetes_pods import pin_to, pin_within

_COPY_LAUNCHER = (
    "import os, shutil, airflow_elastic_gpu.sidecar as s; d = os.path.dirname(s.__file__); "
    f"[shutil.copy(os.path.join(d, f), '{SHARED}') for f in ('launcher.py', 'protocol.py')]; "
    f"os.makedirs('{JOB_DIR}', exist_ok=True)"
)
GPU_TOLERATION = k8s.V1Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")
"""Every pod tolerates the taint that GPU node pools carry (GKE's ``nvidia.com/gpu=present``, the
NVIDIA GPU operator's): the broker chose the node for its GPUs, and the pod requests none from the
device plugin, so the admission controller that adds this toleration to GPU pods passes it by."""
TERMINATION_GRACE_S = 120
"""A pod's ``terminationGracePeriodSeconds``: the trainer's time to checkpoint when it is deleted."""
_SIDECAR_REQUESTS = {"cpu": "50m", "memory": "128Mi"}
_SIDECAR_LIMITS = {"cpu": "1", "memory": "256Mi"}
"""The requests and limits of the backend's own containers (the agent, the launcher's copy): a
namespace with a compute ResourceQuota refuses a pod whose containers lack either. The agent uses
about 25 MiB; its CPU limit is a whole core, so that a Python start and a burst of log parsing are
not throttled past a heartbeat (a fence)."""


def literal(value: str) -> str:
    """``value`` as a container's ``args`` or an env var's ``value`` that Kubernetes passes as it is:
    it expands ``$(NAME)`` from the container's environment and makes ``$$`` one ``$`` there
    (``V1Container.args``), which the local backend, with no shell, never does."""
    return value.replace("$", "$$")


def _sidecar_resources() -> k8s.V1ResourceRequirements:
    """A container of the backend's own: :data:`_SIDECAR_REQUESTS` and :data:`_SIDECAR_LIMITS`."""
    return k8s.V1ResourceRequirements(requests=dict(_SIDECAR_REQUESTS), limits=dict(_SIDECAR_LIMITS))


class PodBuilder:
    """Builds the job's Secret and Pod (pure: no API calls)."""

    def __init__(self, config: KubernetesJobConfig) -> None:
        self.config = config

    def secret(self, job_id: str, token: str) -> k8s.V1Secret:
        return k8s.V1Secret(
            api_version="v1", kind="Secret",
            metadata=k8s.V1ObjectMeta(name=resource_name("elastic-gpu-token", job_id),
                                      namespace=self.config.namespace, labels=self._labels(job_id, None, {})),
            type="Opaque", string_data={TOKEN_KEY: token},
        )

    def _labels(self, job_id: str, generation: int | None, context: dict[str, str]) -> dict[str, str]:
        """The user's labels, then the backend's own (last, so that nothing overrides them)."""
        labels = {**self.config.labels,
                  **{f"{LABEL_PREFIX}{k}": context_label(k, v) for k, v in context.items()},
                  LABEL_MANAGED_BY: MANAGED_BY, LABEL_JOB: label_value(job_id)}
        if generation is not None:
            labels[LABEL_GENERATION] = str(generation)
        return labels

    def pod(self, job_id: str, command: str, node: str, generation: int, *,
            progress_pattern: str | None = None, checkpoint_dir: str | None = None,
            env: Mapping[str, str] | None = None, context: Mapping[str, str] | None = None) -> k8s.V1Pod:
        """The pod of ``job_id``'s ``generation`` on ``node``.

        :param context: dag_id, task_id, run_id, map_index... (labels and annotations).

        The job's token is a Secret volume mounted into the agent only, which reads the file on
        each request: a token rotated in the Secret reaches a running agent (the kubelet refreshes
        the file within its sync period) and the trainer never sees it.
        """
        c = self.config
        context = dict(context or {})
        shared_mount = k8s.V1VolumeMount(name="elastic", mount_path=SHARED)
        user_mounts = [model("V1VolumeMount", m) for m in c.volume_mounts]
        agent_args = ["--job-id", job_id, "--shared-dir", JOB_DIR, "--broker-api", c.broker_api_url,
                      "--token-file", f"{TOKEN_DIR}/{TOKEN_KEY}", "--poll-s", "2"]
        if progress_pattern:
            agent_args += ["--progress-pattern", literal(progress_pattern)]
        if c.resize_mechanism == "recreate":  # this pod runs this generation only; the next is a new pod
            agent_args += ["--pod-generation", str(generation)]
        agent_args += ["--host-node", node]  # a generation on another node is left to a new pod there
        sidecar_context = model("V1SecurityContext", hardened_security_context(read_only_root=True))
        copy_launcher = k8s.V1Container(
            name="copy-launcher", image=c.agent_image, command=["python", "-c", _COPY_LAUNCHER],
            volume_mounts=[shared_mount], security_context=sidecar_context, resources=_sidecar_resources())
        agent = k8s.V1Container(
            name="elastic-agent", image=c.agent_image, restart_policy="Always",
            command=["python", "-m", "airflow_elastic_gpu.sidecar.agent"], args=agent_args,
            volume_mounts=[shared_mount, k8s.V1VolumeMount(name="elastic-token", mount_path=TOKEN_DIR,
                                                           read_only=True)],
            security_context=sidecar_context, resources=_sidecar_resources())
        trainer_context = (hardened_security_context(read_only_root=False) if c.trainer_security_context is None
                           else c.trainer_security_context)
        launcher_args = ["--shared-dir", JOB_DIR, "--echo"]  # the trainer's output in the container's log
        if checkpoint_dir:
            launcher_args += ["--checkpoint-dir", checkpoint_dir]
        trainer = k8s.V1Container(
            name="trainer", image=c.image, command=["python3", f"{SHARED}/launcher.py"],
            args=[*map(literal, launcher_args), "--", literal(command)],
            env=[k8s.V1EnvVar(name="NVIDIA_VISIBLE_DEVICES", value="all"),
                 *(k8s.V1EnvVar(name=k, value=literal(v)) for k, v in sorted((env or {}).items()))],
            volume_mounts=[shared_mount, *user_mounts],
            security_context=model("V1SecurityContext", trainer_context) if trainer_context else None,
            resources=model("V1ResourceRequirements", c.container_resources) if c.container_resources else None)
        token_volume = k8s.V1Volume(name="elastic-token", secret=k8s.V1SecretVolumeSource(
            secret_name=resource_name("elastic-gpu-token", job_id),
            default_mode=0o440 if c.run_as_group is not None else 0o444))  # fsGroup: readable by the agent
        pod = k8s.V1Pod(
            api_version="v1", kind="Pod",
            metadata=k8s.V1ObjectMeta(
                name=resource_name("elastic-gpu", job_id, generation), namespace=c.namespace,
                labels=self._labels(job_id, generation, {k: v for k, v in context.items() if k != "run_id"}),
                annotations={**c.annotations, **{f"{LABEL_PREFIX}{k}": v for k, v in context.items()},
                             LABEL_JOB: job_id}),
            spec=k8s.V1PodSpec(
                affinity=pin_to(node), restart_policy="Never", runtime_class_name=c.runtime_class_name,
                init_containers=[copy_launcher, agent], containers=[trainer],
                volumes=[k8s.V1Volume(name="elastic", empty_dir=k8s.V1EmptyDirVolumeSource()), token_volume,
                         *(model("V1Volume", v) for v in c.volumes)],
                tolerations=[GPU_TOLERATION, *(model("V1Toleration", t) for t in c.tolerations)],
                image_pull_secrets=[k8s.V1LocalObjectReference(name=n) for n in c.image_pull_secrets] or None,
                service_account_name=c.service_account_name,
                automount_service_account_token=c.automount_service_account_token,
                security_context=k8s.V1PodSecurityContext(
                    run_as_user=c.run_as_user, run_as_group=c.run_as_group, fs_group=c.run_as_group,
                    fs_group_change_policy="OnRootMismatch" if c.run_as_group is not None else None,
                    seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault")),
                termination_grace_period_seconds=TERMINATION_GRACE_S,
            ),
        )
        if c.pod_template_file or c.full_pod_spec:  # Airflow's pod generator, only when it is needed
            from airflow.providers.cncf.kubernetes.pod_generator import PodGenerator

            template, own = self._template(), pod.spec.tolerations
            pod = PodGenerator.reconcile_pods(copy.deepcopy(template), pod)
            # the generated list and affinity would replace the template's whole: its tolerations
            # are kept beside ours (the scheduler applies taints), its affinity pinned to the node
            base = template.spec or k8s.V1PodSpec(containers=[])  # a template of metadata only has none
            pod.spec.tolerations = [*(t for t in base.tolerations or [] if t not in own), *own]
            pod.spec.affinity = pin_within(base.affinity, node)
            pod = checked_merge(pod, c)
        return pod

    def _template(self) -> k8s.V1Pod:
        """The base pod of ``pod_template_file`` or ``full_pod_spec`` (one of them is set)."""
        from airflow.providers.cncf.kubernetes.pod_generator import PodGenerator

        c = self.config
        return PodGenerator.deserialize_model_dict(
            read_pod_template(c.pod_template_file) if c.pod_template_file else c.full_pod_spec)
