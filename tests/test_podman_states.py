"""The container harness's reading of podman's container states as Kubernetes pod phases (no podman
needed): a container that is still stopping is not a pod that succeeded."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "containers"))


@pytest.mark.parametrize(("state", "phase"), [
    ({"Status": "created"}, "Pending"),
    ({"Status": "running"}, "Running"),
    ({"Status": "stopping", "ExitCode": 0}, "Running"),  # read as Succeeded: its exit code is 0 until it exits
    ({"Status": "removing", "ExitCode": 0}, "Running"),
    ({"Status": "exited", "ExitCode": 0}, "Succeeded"),
    ({"Status": "exited", "ExitCode": 137}, "Failed"),
    ({"Status": "stopped", "ExitCode": 1}, "Failed"),
])
def test_a_trainer_containers_state_is_its_pods_phase(state, phase):
    from podman_core import pod_status_of

    from airflow_elastic_gpu.backends.kubernetes_pods import pod_problem

    status = pod_status_of(state)
    assert status.phase == phase
    if phase == "Failed":
        pod = type("Pod", (), {"status": status, "metadata": type("M", (), {"name": "p"})()})()
        assert "trainer container terminated: Error" in pod_problem(pod)
