"""The GPU pool page in a real browser (Debian's chromium, headless) while a small job runs."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

from airflow_elastic_gpu.backends.local import LocalBackend
from airflow_elastic_gpu.broker.types import JobSpec

from conftest import REPO
from test_api import api_server, broker  # noqa: F401 - fixtures
from test_sidecar import TRAINER, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture
def chrome():
    if not (CHROMIUM and CHROMEDRIVER):
        if os.environ.get("CI"):
            pytest.fail("chromium and chromedriver are required in CI (make test installs them)")
        pytest.skip("chromium/chromedriver not installed (make test installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1400"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def test_pool_page_shows_the_running_job_in_grid_timeline_and_table(tmp_path, broker, api_server, chrome):  # noqa: F811
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    job = broker.submit(JobSpec("resnet-demo", f"{sys.executable} {trainer} x 4000", 1, 2, total_steps=4000))
    backend = LocalBackend(tmp_path / "jobs", broker, poll_s=0.2)
    broker.start(job.id, backend.start(job))
    try:
        wait_for(lambda: broker.job(job.id).steps_done > 5, 60, "the job to make progress")
        chrome.get(f"{api_server}/ui?pool=default&job={job.id}")
        wait_for(lambda: chrome.execute_script("return document.body.dataset.ready === '1'"), 30, "page data")
        wait_for(lambda: chrome.execute_script(
            "return document.querySelectorAll('#timeline .bars path, #timeline .point').length > 0"), 30,
            "timeline to draw")
        cells = chrome.execute_script(
            "return [...document.querySelectorAll('.gpu')].map(c => [c.dataset.job, c.textContent])")
        held = [text for holder, text in cells if holder == job.id]
        assert len(held) == 2 and all("resnet-demo" in t for t in held)  # the grid shows who holds what
        focused = chrome.execute_script("return document.querySelectorAll('.gpu.focus').length")
        assert focused == 2  # the extra link's ?job= highlights the job
        timeline_text = chrome.execute_script("return document.getElementById('timeline').textContent")
        assert "resnet-demo" in timeline_text and "2 GPUs" in timeline_text
        row = chrome.execute_script("return document.querySelector('#jobs tr.focus').textContent")
        assert "resnet-demo" in row and "running" in row
        out = tmp_path / "gpu_pool_page.png"
        chrome.save_screenshot(str(out))
        assert out.read_bytes()[:4] == b"\x89PNG"
        if os.environ.get("UPDATE_DOCS_SCREENSHOT"):
            shutil.copy(out, REPO / "docs" / "gpu_pool_page.png")
    finally:
        broker.cancel(job.id)
        backend.stop(job.id, timeout_s=10)
