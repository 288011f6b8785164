"""The pool page and the broker's serving against careless deployments: the page's content
security policy and headers (also mounted inside Airflow), the API docs off unless asked for, the
UI token beyond loopback, and the image and compose file that never serve open views (the API
against hostile clients: ``test_api_security.py``)."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from conftest import REPO
from fastapi.testclient import TestClient
from test_api import broker, client  # noqa: F401 - fixtures
from test_api_security import MiB, running_job

from airflow_elastic_gpu.broker.api import check_bind_address, create_app
from airflow_elastic_gpu.broker.api_guards import PAGE_CSP
from airflow_elastic_gpu.cli import main as cli


def test_the_page_has_a_csp_and_no_inline_script(client):  # noqa: F811
    page = client.get("/ui")
    csp = page.headers["content-security-policy"]
    assert csp == PAGE_CSP
    for directive in ("default-src 'none'", "script-src 'self';", "object-src 'none'", "base-uri 'none'",
                      "frame-ancestors 'self'"):
        assert directive in csp
    assert "unsafe-eval" not in csp and "'unsafe-inline'" not in csp.split("script-src")[1].split(";")[0]
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["referrer-policy"] == "no-referrer"
    scripts = re.findall(r"<script([^>]*)>(.*?)</script>", page.text, re.DOTALL)
    assert scripts and all('src="ui/' in attrs and not body.strip() for attrs, body in scripts)
    assert "style=" not in page.text and "<style" not in page.text
    for asset, media_type in (("pool.js", "text/javascript"), ("pool.css", "text/css"),
                              ("plotly.min.js", "text/javascript")):
        r = client.get(f"/ui/{asset}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(media_type)
        assert r.headers["content-security-policy"] == PAGE_CSP
        assert r.headers["x-content-type-options"] == "nosniff"
    code = [line for line in client.get("/ui/pool.js").text.splitlines() if not line.lstrip().startswith("//")]
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert not any(sink in line for line in code), sink  # the page builds its DOM from text only


def test_every_answer_says_nosniff_and_that_it_comes_from_the_broker(broker, client):  # noqa: F811
    """The agent stops its trainer on a 401/403/404/410 only when the broker's header says the
    broker answered (not a proxy in front of it)."""
    job = running_job(broker)
    for r in (client.get("/api/v1/pools"), client.post(f"/api/v1/jobs/{job.id}/heartbeat"),
              client.get("/openapi.json"), client.get("/nowhere"), client.post("/api/v1/jobs/nope/heartbeat")):
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["x-elastic-gpu-broker"] == "1"


def test_swagger_and_redoc_are_off_unless_asked_for(broker):  # noqa: F811
    off = TestClient(create_app(broker))
    assert off.get("/docs").status_code == 404 and off.get("/redoc").status_code == 404
    assert off.get("/openapi.json").json()["info"]["title"] == "airflow-elastic-gpu broker API"
    on = TestClient(create_app(broker, api_docs=True))
    assert on.get("/docs").status_code == 200 and on.get("/redoc").status_code == 200


def test_mounted_as_airflow_mounts_plugins_the_headers_and_limits_hold(broker):  # noqa: F811
    from fastapi import FastAPI

    airflow = FastAPI()  # Airflow's api-server mounts each plugin app: app.mount(url_prefix, subapp)
    airflow.mount("/elastic-gpu", create_app(broker, ui_dependencies=[]))
    c = TestClient(airflow)
    assert c.get("/elastic-gpu/ui").headers["content-security-policy"] == PAGE_CSP
    assert c.get("/elastic-gpu/ui/pool.js").headers["content-security-policy"] == PAGE_CSP
    pools = c.get("/elastic-gpu/api/v1/pools")
    assert pools.json() == ["default"] and "content-security-policy" not in pools.headers
    assert pools.headers["x-content-type-options"] == "nosniff"
    job = running_job(broker)
    r = c.post(f"/elastic-gpu/api/v1/jobs/{job.id}/finish", content=b"{}",
               headers={"Content-Length": str(100 * MiB)})
    assert r.status_code == 413


def test_with_a_ui_token_the_page_loads_its_assets_without_it(broker, monkeypatch):  # noqa: F811
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_UI_TOKEN", "s3cret")
    c = TestClient(create_app(broker))
    assert c.get("/ui").status_code == 401
    assert c.get("/ui", params={"token": "s3cret"}).status_code == 200
    # <script src="ui/pool.js"> carries no token: the assets hold no data and are served to anyone
    assert c.get("/ui/pool.js").status_code == 200 and c.get("/ui/plotly.min.js").status_code == 200
    assert c.get("/api/v1/pools/default/snapshot").status_code == 401


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_serving_on_loopback_needs_no_ui_token(host):
    check_bind_address(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "broker.example.com"])
def test_serving_beyond_loopback_needs_the_ui_token(host):
    with pytest.raises(ValueError, match="set \\$AIRFLOW_ELASTIC_GPU_UI_TOKEN"):
        check_bind_address(host, None)
    check_bind_address(host, "s3cret")


def test_broker_serve_refuses_an_open_public_address(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("AIRFLOW_ELASTIC_GPU_UI_TOKEN", raising=False)
    code = cli(["--broker-url", f"sqlite:///{tmp_path / 'b.db'}", "broker", "serve", "--host", "0.0.0.0"])
    assert code == 2
    captured = capsys.readouterr()
    out = " ".join((captured.out + captured.err).split())
    assert "--host 0.0.0.0 would let anyone who reaches it read every job" in out
    assert not (tmp_path / "b.db").exists()  # refused before touching the database
    assert cli(["--broker-url", f"sqlite:///{tmp_path / 'b.db'}", "broker", "serve", "--max-body-bytes", "-1"]) == 2
    assert "--max-body-bytes must be a positive integer" in capsys.readouterr().err and not (tmp_path / "b.db").exists()


def test_the_image_and_compose_file_do_not_serve_open_views():
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())["services"]["broker"]
    assert all(str(p).startswith("127.0.0.1:") for p in compose["ports"])
    assert "AIRFLOW_ELASTIC_GPU_UI_TOKEN" in compose["environment"]
    cmd = re.search(r"^CMD (.+)$", (REPO / "docker" / "Dockerfile.agent").read_text(), re.MULTILINE).group(1)
    args = json.loads(cmd)
    host = args[args.index("--host") + 1]
    with pytest.raises(ValueError):  # the image's default command starts only with the UI token
        check_bind_address(host, None)


def test_the_airflow_plugin_refuses_its_views_where_it_cannot_check_airflows_login(broker, monkeypatch):  # noqa: F811
    """An Airflow whose auth helpers moved: the plugin's views were open to anyone who reached
    Airflow's server (no check at all); they are refused instead."""
    import builtins

    from airflow_elastic_gpu import plugins

    real_import = builtins.__import__

    def moved(name, *args, **kwargs):
        if name.startswith("airflow.api_fastapi"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", moved)
    guards = plugins._ui_auth()
    monkeypatch.setattr(builtins, "__import__", real_import)
    c = TestClient(create_app(broker, ui_dependencies=guards))
    refused = c.get("/api/v1/pools/default/snapshot")
    assert refused.status_code == 403 and "broker serve" in refused.json()["detail"]
