"""Real containers (opt-in, ``make test-containers``): the generated pod runs with podman.

Needs podman, runc, slirp4netns and the images of ``make images``; deselected by ``make test``
(marker ``containers``). See docs/kubernetes.md, "Real containers with podman".
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "containers"))

pytestmark = [pytest.mark.containers,
              pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed (make images)")]


@pytest.fixture(scope="module")
def images():
    from build_images import AGENT_IMAGE, TRAINER_IMAGE, image_exists

    missing = [tag for tag in (AGENT_IMAGE, TRAINER_IMAGE) if not image_exists(tag)]
    if missing:
        pytest.fail(f"images {missing} are missing: run make images")


@pytest.mark.parametrize("mechanism", ["inplace", "recreate"])
def test_a_real_job_trains_in_the_generated_pod_and_resumes_across_resizes(images, mechanism):
    from run_job import run

    result = run(mechanism, total_steps=600)
    print(result.to_dict())
    assert result.status == "succeeded", result
    assert result.accuracy is not None and result.accuracy >= 0.9
    assert result.steps_done == result.total_steps
    assert result.num_resizes == 2 and result.generations == 3  # 2 -> 1 -> 2 GPUs
    assert [(r.from_gpus, r.to_gpus) for r in result.resizes] == [(2, 1), (1, 2)]
    expected_pods = 1 if mechanism == "inplace" else result.generations  # the pod stays, or one per generation
    assert result.pods_created == expected_pods
    for resize in result.resizes:  # each trainer checkpointed on SIGTERM and the next resumed there
        assert resize.stopped_step is not None and resize.stopped_step > 0, resize
        assert resize.resumed_step == resize.stopped_step, resize
        assert resize.first_step_at is not None, resize
