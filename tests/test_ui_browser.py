"""The GPU pool page in a real browser (Debian's chromium, headless): a small job running, and hostile
text from the API shown as text under the page's Content-Security-Policy."""

from __future__ import annotations

import os
import shutil
import sys

import httpx
import pytest
from conftest import REPO, RESIZE_AT_ONCE
from test_api import api_server, broker  # noqa: F401 - fixtures
from test_sidecar import TRAINER, wait_for

from airflow_elastic_gpu.backends.local import LocalBackend
from airflow_elastic_gpu.broker.types import JobSpec

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
    # before any page script: record CSP violations and uncaught errors (this script itself is
    # exempt from the page's CSP)
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": """
        window.__csp = []; window.__errors = [];
        document.addEventListener('securitypolicyviolation',
            e => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));
        window.addEventListener('error', e => window.__errors.push(String(e.message)));
        window.addEventListener('unhandledrejection', e => window.__errors.push(String(e.reason)));
    """})
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
        assert chrome.execute_script("return [window.__csp, window.__errors]") == [[], []]  # plotly too
        out = tmp_path / "gpu_pool_page.png"
        chrome.save_screenshot(str(out))
        assert out.read_bytes()[:4] == b"\x89PNG"
        if os.environ.get("UPDATE_DOCS_SCREENSHOT"):
            shutil.copy(out, REPO / "docs" / "gpu_pool_page.png")
    finally:
        broker.cancel(job.id)
        backend.stop(job.id, timeout_s=10)


HOSTILE = "<img src=x onerror=document.title='XSS-'+document.domain>"


def test_hostile_names_reasons_and_metrics_are_shown_as_text(broker, api_server, chrome):  # noqa: F811
    # a DAG author's job name, an agent's fail reason and a trainer's metrics, the last two through
    # the real HTTP API with the jobs' own tokens
    name = "<b>bold</b><svg onload=document.title='XSS-name'>"
    reason = "<script>document.title='XSS-reason'</script><a href=javascript:alert(1)>x</a>"
    finished = broker.submit(JobSpec(name, "train", 1, 1, total_steps=100))
    failed = broker.submit(JobSpec("plain", "train", 1, 1, total_steps=100))
    forged = broker.submit(JobSpec("forged", "train", 1, 1, total_steps=100))
    for job in (finished, failed, forged):
        broker.ack(job.id, 1)
    r = httpx.post(f"{api_server}/api/v1/jobs/{finished.id}/finish", json={"metrics": {"accuracy": HOSTILE}},
                   headers={"Authorization": f"Bearer {finished.token}"})
    assert r.status_code == 200 and r.json()["metrics"] == {"accuracy": HOSTILE}
    r = httpx.post(f"{api_server}/api/v1/jobs/{failed.id}/fail", json={"reason": reason},
                   headers={"Authorization": f"Bearer {failed.token}"})
    assert r.status_code == 200
    # an infinite throughput (forged through the database path, which takes the caller's times)
    broker.progress(forged.id, 0.0, generation=1, time_s=1e-300)
    broker.progress(forged.id, 1e308, generation=1, time_s=2e-300)

    chrome.get(f"{api_server}/ui?pool=default")
    wait_for(lambda: chrome.execute_script("return document.body.dataset.ready === '1'"), 30, "page data")
    refreshed = chrome.execute_script("return document.getElementById('updated').textContent")
    wait_for(lambda: chrome.execute_script("return document.getElementById('updated').textContent") != refreshed,
             30, "a second refresh")

    assert chrome.title == "Elastic GPU pool"
    injected = chrome.execute_script(
        "return document.querySelectorAll('img, svg [onload], [onerror], [onload], a[href^=javascript], "
        "body script, #jobs b, #events b').length")
    assert injected == 0
    rows = dict(chrome.execute_script(
        "return [...document.querySelectorAll('#jobs tbody tr')].map(r => [r.dataset.job, r.textContent])"))
    assert name in rows[finished.id] and f"accuracy {HOSTILE}" in rows[finished.id]
    assert reason in rows[failed.id]
    throughput = chrome.execute_script(
        f"return document.querySelector('#jobs tr[data-job=\"{forged.id}\"] td:nth-child(5)').textContent")
    assert throughput == "-"  # an infinite throughput never reaches the page
    events = chrome.execute_script("return document.querySelector('#events').textContent")
    assert "succeeded" in events or "finished" in events
    timeline = chrome.execute_script("return document.getElementById('timeline').textContent")
    assert "<b>bold</b>" in timeline  # plotly's own markup is escaped too: the tags show as text
    assert chrome.execute_script("return [window.__csp, window.__errors]") == [[], []]
    assert not chrome.execute_script("return document.getElementById('updated').textContent").startswith(
        "could not load")


def test_two_jobs_of_one_name_are_told_apart_and_a_gpu_not_yet_taken_up_is_shown_handed_over(
        broker, api_server, chrome):  # noqa: F811
    """Two runs of one task (the job name is the task id) share a name: the grid and the timeline's
    rows name each with the start of its id. A GPU published to a job whose trainer does not run on
    it yet is drawn dashed, as the legend says, not as held."""
    running = broker.submit(JobSpec("train", "train", 2, 2, total_steps=100))
    broker.ack(running.id, 1)
    starting = broker.submit(JobSpec("train", "train", 2, 2, total_steps=100))  # published, not acked
    chrome.get(f"{api_server}/ui?pool=default")
    wait_for(lambda: chrome.execute_script("return document.body.dataset.ready === '1'"), 30, "page data")
    cells = chrome.execute_script(
        "return [...document.querySelectorAll('.gpu')].map(c => [c.dataset.job, c.textContent, "
        "c.classList.contains('moving')])")
    by_job = {job: {(text, moving) for holder, text, moving in cells if holder == job}
              for job in (running.id, starting.id)}
    assert len(by_job[running.id]) == len(by_job[starting.id]) == 2
    assert all(f"train · {running.id[:8]}" in t and not moving for t, moving in by_job[running.id])
    assert all(f"train · {starting.id[:8]}" in t and moving for t, moving in by_job[starting.id])
    timeline = chrome.execute_script("return document.getElementById('timeline').textContent")
    assert f"train · {running.id[:8]}" in timeline
    assert chrome.execute_script("return [window.__csp, window.__errors]") == [[], []]


def test_a_gpu_out_of_service_is_drawn_as_such_on_the_page_and_in_status(broker, api_server, chrome, capsys):  # noqa: F811
    from airflow_elastic_gpu.cli import main

    broker.set_gpus_healthy("n0", [2], False)
    chrome.get(f"{api_server}/ui?pool=default")
    wait_for(lambda: chrome.execute_script("return document.body.dataset.ready === '1'"), 30, "page data")
    cells = chrome.execute_script(
        "return [...document.querySelectorAll('.gpu')].map(c => [c.textContent, c.classList.contains('unhealthy'), "
        "c.title])")
    assert [(text, out) for text, out, _ in cells] == [
        ("n0:0free", False), ("n0:1free", False), ("n0:2out of service", True), ("n0:3free", False)]
    assert "out of service" in cells[2][2]
    assert main(["--broker-url", str(broker.engine.url), "status"]) == 0
    assert "out of service" in capsys.readouterr().out


def test_two_old_runs_of_one_name_known_only_from_the_timeline_are_told_apart(
        broker, api_server, chrome):  # noqa: F811
    """Runs ended before the snapshot's latest 100 ended jobs get their names from the timeline:
    two of one task still get a row each, named with the start of their ids."""
    old = []
    for _ in range(2):
        job = broker.submit(JobSpec("nightly", "train", 2, 2, total_steps=100))
        broker.ack(job.id, 1)
        broker.finish(job.id)
        old.append(job.id)
    for i in range(100):
        broker.finish(broker.submit(JobSpec(f"later-{i}", "train", 1, 1, total_steps=10)).id)
    chrome.get(f"{api_server}/ui?pool=default")
    wait_for(lambda: chrome.execute_script("return document.body.dataset.ready === '1'"), 30, "page data")
    timeline = chrome.execute_script("return document.getElementById('timeline').textContent")
    assert all(f"nightly · {job_id[:8]}" in timeline for job_id in old), timeline[:500]


@pytest.fixture
def serve():
    """``serve(broker, **create_app_kwargs)``: the broker's API on a free port, stopped at the end."""
    import threading

    import uvicorn
    from test_api import free_port

    from airflow_elastic_gpu.broker.api import create_app

    servers = []

    def start(b, **kw) -> str:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(b, **kw), host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        wait_for(lambda: server.started, 20, "API server to start")
        servers.append(server)
        return f"http://127.0.0.1:{port}"

    yield start
    for server in servers:
        server.should_exit = True


def test_the_ui_token_goes_to_the_api_as_a_header_not_in_its_urls(broker, serve, chrome):  # noqa: F811
    """A page opened with ``?token=``: each API call (every 2 s) sends the token as a header, never
    in a URL that a proxy in front of the server would log."""
    url = serve(broker, ui_token="s3cret-token")
    assert httpx.get(f"{url}/api/v1/pools").status_code == 401
    chrome.get(f"{url}/ui?pool=default&token=s3cret-token")
    wait_for(lambda: chrome.execute_script("return document.body.dataset.ready === '1'"), 30, "page data")
    requested = chrome.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    calls = [r for r in requested if "/api/v1/" in r]
    assert any("/snapshot" in r for r in calls) and not any("s3cret" in r for r in calls), calls
    assert not chrome.execute_script("return document.getElementById('updated').textContent").startswith("could not")
    assert chrome.execute_script("return [window.__csp, window.__errors]") == [[], []]


def test_a_broker_without_pools_says_how_to_add_gpus(tmp_path, serve, chrome):
    """A new broker has no pool: the page says what to do, not "could not load: ... HTTP 404"."""
    from airflow_elastic_gpu.broker.service import GpuBroker

    empty = GpuBroker(f"sqlite:///{tmp_path / 'empty.db'}")
    try:
        chrome.get(f"{serve(empty)}/ui")
        wait_for(lambda: "no GPU pool yet" in chrome.execute_script(
            "return document.getElementById('updated').textContent"), 30, "the page's message")
        assert "nodes add" in chrome.execute_script("return document.getElementById('updated').textContent")
    finally:
        empty.engine.dispose()


def test_jobs_named_like_a_date_or_a_number_each_keep_their_timeline_row(broker, api_server, chrome):  # noqa: F811
    """Plotly guesses an axis' type from its first values: a job named ``2026-11-28`` (a ``{{ ds }}``
    name) made the rows a date axis, and every other job's row vanished."""
    for name in ("2026-11-28", "42", "train"):
        broker.ack(broker.submit(JobSpec(name, "train", 1, 1, total_steps=100)).id, 1)
    chrome.get(f"{api_server}/ui?pool=default")
    wait_for(lambda: chrome.execute_script("return document.body.dataset.ready === '1'"), 30, "page data")
    assert chrome.execute_script("return document.getElementById('timeline').layout.yaxis.type") == "category"
    rows = chrome.execute_script("return [...document.querySelectorAll('#timeline .ytick')].map(t => t.textContent)")
    assert {"2026-11-28", "42", "train"} <= set(rows), rows


def test_a_broker_out_of_reach_is_said_with_the_time_of_the_data_shown(broker, api_server, chrome):  # noqa: F811
    """The API stops answering after the page has shown data: the page says it could not load and
    since when its data is, instead of showing old data as current."""
    chrome.get(f"{api_server}/ui?pool=default")
    wait_for(lambda: chrome.execute_script("return document.body.dataset.ready === '1'"), 30, "page data")
    chrome.execute_cdp_cmd("Network.enable", {})
    chrome.execute_cdp_cmd("Network.emulateNetworkConditions", {
        "offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1})
    def status() -> str:
        return chrome.execute_script("return document.getElementById('updated').textContent")

    wait_for(lambda: status().startswith("could not load"), 30, "the page to notice")
    assert "the data shown is from " in status(), status()


def test_a_task_instances_tab_shows_the_job_it_submitted_or_says_it_has_none(broker, clock, api_server,  # noqa: F811
                                                                              chrome):
    """Airflow's "GPU job" tab opens the page with the task instance's ids (an unmapped task's map
    index as the UI's placeholder): the task's job is highlighted, in its own pool, while it trains
    (the extra link of a ``start_from_trigger`` task comes only after); a task without a job, and a
    linked job older than the jobs listed, are said so."""
    from airflow_elastic_gpu.broker.types import task_key

    job = broker.submit(JobSpec("train", "train", 1, 1, total_steps=100, key=task_key("etl", "train", "r1", -1)))
    broker.ack(job.id, 1)
    other = broker.submit(JobSpec("other", "train", 1, 1, total_steps=100))
    broker.ack(other.id, 1)
    chrome.get(f"{api_server}/ui?dag_id=etl&run_id=r1&task_id=train&map_index=%7BMAP_INDEX%7D")
    wait_for(lambda: chrome.execute_script("return document.body.dataset.ready === '1'"), 30, "page data")
    wait_for(lambda: chrome.execute_script("return [...document.querySelectorAll('#jobs tr.focus')]"
                                           ".map(r => r.dataset.job)") == [job.id], 30, "the task's job highlighted")
    chrome.get(f"{api_server}/ui?dag_id=etl&run_id=r1&task_id=report")
    def status() -> str:
        return chrome.execute_script("return document.getElementById('updated').textContent")

    wait_for(lambda: status().startswith("this task has submitted no GPU job"), 30, "the page to say so")
    assert chrome.execute_script("return document.querySelectorAll('#jobs tr.focus').length") == 0
    broker.finish(other.id)
    clock.advance(10)
    for i in range(101):  # the snapshot lists the latest 100 ended jobs
        broker.finish(broker.submit(JobSpec(f"later-{i}", "t", 1, 1, total_steps=1)).id)
    chrome.get(f"{api_server}/ui?job={other.id}")
    wait_for(lambda: chrome.execute_script("return document.body.dataset.ready === '1'"), 30, "page data")
    assert status().startswith(f"job other ({other.id[:8]}) ended succeeded"), status()
    assert chrome.execute_script("return [window.__csp, window.__errors]") == [[], []]


def test_the_pool_list_shows_the_pool_of_a_task_job_that_came_later_and_a_zoom_stays(broker, api_server,  # noqa: F811
                                                                                     chrome):
    """A "GPU job" tab opened before its task submitted: the page drew the job's pool once it came,
    but the pool list still read ``default`` (and choosing it did nothing); and every refresh undid
    the timeline's zoom."""
    from airflow_elastic_gpu.broker.types import task_key

    broker.register_node("a100-box", 2, pool="a100")
    chrome.get(f"{api_server}/ui?dag_id=etl&run_id=r1&task_id=train")
    wait_for(lambda: chrome.execute_script("return document.body.dataset.ready === '1'"), 30, "page data")
    assert chrome.execute_script("return document.getElementById('pool').value") == "default"
    job = broker.submit(JobSpec("train", "train", 1, 1, total_steps=100, key=task_key("etl", "train", "r1", -1),
                                pool="a100"))
    broker.ack(job.id, 1)
    wait_for(lambda: chrome.execute_script("return [...document.querySelectorAll('#jobs tr.focus')]"
                                           ".map(r => r.dataset.job)") == [job.id], 30, "the task's job shown")
    assert chrome.execute_script("return document.getElementById('pool').value") == "a100"
    assert chrome.execute_script("return document.getElementById('timeline').layout.uirevision") == "a100"
    assert chrome.execute_script("return [window.__csp, window.__errors]") == [[], []]
    # the colours kept are those of the jobs shown (a page open for weeks kept every job's)
    chrome.execute_script("document.getElementById('pool').value = 'default';"
                          "document.getElementById('pool').dispatchEvent(new Event('change'))")
    wait_for(lambda: chrome.execute_script("return document.getElementById('timeline').layout.uirevision")
             == "default", 30, "the default pool shown")
    assert chrome.execute_script("return [...colourOf.keys()]") == []  # a100's job is not shown here


def test_a_sweep_of_many_short_jobs_is_one_bar_trace_of_the_latest_rows_redrawn_only_on_change(
        broker, clock, api_server, chrome):  # noqa: F811
    """The timeline's window holds thousands of short jobs: a plotly trace per job, redrawn every
    refresh, blocked the page for seconds and squeezed a row per job into the chart. All bars are
    one trace, of the running jobs and the latest ended ones, the page says how many it shows, and a
    refresh that changes nothing draws nothing."""
    broker.configure_pool(policy_params=RESIZE_AT_ONCE, lease_s=10**6)
    for i in range(620):
        job = broker.submit(JobSpec(f"sweep-{i}", "t", 1, 1, total_steps=10))
        broker.ack(job.id, broker.job(job.id).target_generation)
        clock.advance(2)
        broker.finish(job.id)
        clock.advance(1)
    running = broker.submit(JobSpec("still-running", "t", 1, 1, total_steps=10**6))
    broker.ack(running.id, 1)
    chrome.get(f"{api_server}/ui?pool=default")
    wait_for(lambda: chrome.execute_script("return document.body.dataset.ready === '1'"), 120, "page data")
    traces = chrome.execute_script("return document.getElementById('timeline').data.map(t => t.type)")
    assert sorted(traces) == ["bar", "scatter"], len(traces)  # the bars, and the resizes' diamonds
    rows = chrome.execute_script("return [...new Set(document.getElementById('timeline').data[0].y)]")
    assert "still-running" in rows and "sweep-619" in rows and "sweep-0" not in rows
    note = chrome.execute_script("return document.getElementById('timeline-note').textContent")
    assert f"showing the latest {len(rows)} of 621 jobs" in note, note
    # nothing changed (the clock stands still): two more refreshes draw nothing; a job's end does
    chrome.execute_script("window.__reacts = 0; const react = Plotly.react;"
                          "Plotly.react = (...a) => { window.__reacts += 1; return react(...a); };")
    seq = chrome.execute_script("return latest")
    wait_for(lambda: chrome.execute_script("return latest") >= seq + 2, 60, "two more refreshes")
    assert chrome.execute_script("return window.__reacts") == 0
    clock.advance(5)
    broker.finish(running.id)
    wait_for(lambda: chrome.execute_script("return window.__reacts") > 0, 60, "the timeline redrawn")
    assert chrome.execute_script("return [window.__csp, window.__errors]") == [[], []]


def test_a_long_reason_without_spaces_leaves_the_page_no_wider_than_the_window(broker, api_server, chrome):  # noqa: F811
    """A reason of 20,000 characters without a space (a hex dump, a URL; the API takes that many)
    made the jobs and the events tables as wide as that run: it wraps, in a box of a few lines."""
    reason = "0x" + "f" * 19_998
    job = broker.submit(JobSpec("hexdump", "t", 1, 1, total_steps=100))
    broker.ack(job.id, 1)
    broker.fail(job.id, reason)
    chrome.get(f"{api_server}/ui?pool=default")
    wait_for(lambda: chrome.execute_script("return document.body.dataset.ready === '1'"), 30, "page data")
    width, window = chrome.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
    assert width <= window, (width, window)
    cell = chrome.execute_script(
        f"const c = document.querySelector('#jobs tr[data-job=\"{job.id}\"] td:last-child');"
        "return [c.textContent, c.offsetHeight]")
    assert cell[0] == reason and cell[1] < 200, cell[1]  # all of it, in a box that scrolls
    heights = chrome.execute_script("return [...document.querySelectorAll('#events td')].map(c => c.offsetHeight)")
    assert max(heights) < 200, max(heights)
