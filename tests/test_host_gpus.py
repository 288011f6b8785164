"""This host's real GPUs for the local backend: one broker has them (a second one, a broker that
fell back to the ``[elastic_gpu]`` section because the connection could not be read, is refused),
and an ``nvidia-smi`` that fails is an error, never a host of virtual GPUs."""

from __future__ import annotations

import os
import threading
import time

import pytest

from airflow_elastic_gpu.backends import BackendError
from airflow_elastic_gpu.backends.local import LocalBackend
from airflow_elastic_gpu.broker.service import GpuBroker


def fake_nvidia_smi(tmp_path, monkeypatch, script: str) -> None:
    """Put an ``nvidia-smi`` that runs the shell ``script`` first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{script}\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


@pytest.fixture
def two_real_gpus(tmp_path, monkeypatch):
    """An ``nvidia-smi`` on PATH that lists two A100s, as on a GPU host."""
    fake_nvidia_smi(tmp_path, monkeypatch, "printf '0, NVIDIA A100-SXM4-80GB\\n1, NVIDIA A100-SXM4-80GB\\n'")


def test_a_second_broker_cannot_register_or_use_a_hosts_real_gpus(tmp_path, two_real_gpus):
    """Airflow 3 reports a connection it could not read for a moment as not defined; a worker then
    used the ``[elastic_gpu]`` section's broker (a SQLite file by default), which registered the
    host's GPUs anew: two brokers handed the same GPUs to a job each."""
    work_dir = tmp_path / "jobs"
    first, second = (GpuBroker(f"sqlite:///{tmp_path / name}") for name in ("real.db", "fallback.db"))
    assert LocalBackend(work_dir, first).ensure_pool("default").startswith("registered 2 GPU(s)")
    with pytest.raises(BackendError, match=r"handed out by the broker 'sqlite:///.*real\.db'.*fallback\.db"):
        LocalBackend(work_dir, second).ensure_pool("default")
    assert second.nodes() == []
    assert LocalBackend(work_dir, first).ensure_pool("default") is None  # its own: fine
    # a broker that registered them before the claim existed is refused too once another has it
    second.register_node("localhost", pool="default", gpu_type="NVIDIA A100-SXM4-80GB", gpu_indices=(0, 1))
    with pytest.raises(BackendError, match="two brokers would hand the same GPUs to two jobs"):
        LocalBackend(work_dir, second).ensure_pool("default")


def test_a_broker_that_had_a_hosts_real_gpus_before_the_claim_is_recorded_as_theirs(tmp_path, two_real_gpus):
    work_dir = tmp_path / "jobs"
    old, other = (GpuBroker(f"sqlite:///{tmp_path / name}") for name in ("old.db", "other.db"))
    old.register_node("localhost", pool="default", gpu_type="NVIDIA A100-SXM4-80GB", gpu_indices=(0, 1))
    assert LocalBackend(work_dir, old).ensure_pool("default") is None
    with pytest.raises(BackendError, match="old.db"):
        LocalBackend(work_dir, other).ensure_pool("default")


def test_two_airflow_installations_on_one_host_cannot_both_have_its_real_gpus(tmp_path, two_real_gpus):
    """The claim was kept in each installation's work directory (``$AIRFLOW_HOME/elastic_gpu_jobs``):
    a second ``$AIRFLOW_HOME`` on the host, with its own broker, registered the same GPUs."""
    from airflow_elastic_gpu.backends.local_host import CLAIM_FILE

    first, second = (GpuBroker(f"sqlite:///{tmp_path / name}") for name in ("team-a.db", "team-b.db"))
    assert LocalBackend(tmp_path / "home-a" / "jobs", first).ensure_pool("default").startswith("registered 2")
    with pytest.raises(BackendError, match=r"team-a\.db.*team-b\.db"):
        LocalBackend(tmp_path / "home-b" / "jobs", second).ensure_pool("default")
    assert second.nodes() == []
    claim = tmp_path / "host-claim" / CLAIM_FILE  # the host's (the test's [elastic_gpu] host_claim_dir)
    assert claim.stat().st_mode & 0o777 == 0o644 and (claim.parent.stat().st_mode & 0o1777) == 0o1777


def test_a_claim_recorded_in_a_work_directory_is_honoured_and_becomes_the_hosts(tmp_path, two_real_gpus):
    """An installation upgraded from the per-work-directory claim, its pool and jobs in place: its
    next start copies the claim to the host's, so a second installation on the host is refused (it
    was not: the work directory's claim named the broker, and nothing was copied)."""
    from airflow_elastic_gpu.backends.local_host import CLAIM_FILE, broker_identity
    from airflow_elastic_gpu.sidecar import protocol

    work_dir = tmp_path / "jobs"
    old, other = (GpuBroker(f"sqlite:///{tmp_path / name}") for name in ("old.db", "other.db"))
    old.register_node("localhost", pool="default", gpu_type="NVIDIA A100-SXM4-80GB", gpu_indices=(0, 1))
    work_dir.mkdir()
    recorded = {"broker": broker_identity(old.url), "pool": "default"}
    protocol.write_json(work_dir / CLAIM_FILE, recorded)
    assert LocalBackend(work_dir, old).ensure_pool("default") is None  # a job's start after the upgrade
    assert protocol.read_json(tmp_path / "host-claim" / CLAIM_FILE) == recorded
    with pytest.raises(BackendError, match="old.db"):  # another installation: refused
        LocalBackend(tmp_path / "elsewhere", other).ensure_pool("default")
    assert other.nodes() == []
    with pytest.raises(BackendError, match="old.db"):  # and from the work directory's claim alone
        (tmp_path / "host-claim" / CLAIM_FILE).unlink()  # (a container whose /var/tmp is its own)
        LocalBackend(work_dir, other).ensure_pool("default")


def test_brokers_of_virtual_gpus_claim_nothing(tmp_path):
    """Virtual GPUs are CPU processes: a test or a second demo on one host may have brokers of its own."""
    work_dir = tmp_path / "jobs"
    for name in ("one.db", "two.db"):
        assert "virtual" in LocalBackend(work_dir, GpuBroker(f"sqlite:///{tmp_path / name}"),
                                         virtual_gpus=2).ensure_pool("default")


def test_an_installation_of_virtual_gpus_runs_beside_one_that_has_the_hosts_real_gpus(tmp_path, monkeypatch):
    """Another broker's claim of the host's real GPUs refused an installation that hands out
    virtual ones only (every start of its jobs), and was copied into its work directory."""
    from airflow_elastic_gpu.backends.local_host import CLAIM_FILE, broker_identity
    from airflow_elastic_gpu.sidecar import protocol

    claim_dir = tmp_path / "host-claim"
    claim_dir.mkdir()
    protocol.write_json(claim_dir / CLAIM_FILE, {"broker": broker_identity(f"sqlite:///{tmp_path / 'a.db'}"),
                                                 "pool": "default"})
    work_dir = tmp_path / "b-jobs"
    backend = LocalBackend(work_dir, GpuBroker(f"sqlite:///{tmp_path / 'b.db'}"), virtual_gpus=2)
    assert "virtual" in backend.ensure_pool("default")
    assert backend.ensure_pool("default") is None  # a later start of one of its jobs
    assert not (work_dir / CLAIM_FILE).exists()


@pytest.mark.parametrize(("script", "virtual"), [
    ("echo 'No devices were found'; exit 6", True),  # a host with the driver and no GPU
    ("echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver' >&2; exit 9", False),
])
def test_an_nvidia_smi_that_fails_is_an_error_not_a_host_of_virtual_gpus(tmp_path, monkeypatch, script, virtual):
    """A driver that did not answer at a host's first registration made its pool one of virtual GPUs
    for good: jobs got CUDA_VISIBLE_DEVICES of the real ones, which no broker's claim held."""
    fake_nvidia_smi(tmp_path, monkeypatch, script)
    backend = LocalBackend(tmp_path / "jobs", GpuBroker(f"sqlite:///{tmp_path / 'b.db'}"), virtual_gpus=2)
    if virtual:
        assert "2 virtual GPU(s)" in backend.ensure_pool("default")
    else:
        with pytest.raises(BackendError, match="could not communicate with the NVIDIA driver"):
            backend.ensure_pool("default")
        assert backend.broker.nodes() == []


def test_one_broker_spelled_two_ways_is_one_and_a_failed_registration_claims_nothing(tmp_path, two_real_gpus,
                                                                                      monkeypatch):
    from airflow_elastic_gpu.backends.local_host import CLAIM_FILE, broker_identity
    from airflow_elastic_gpu.broker.types import InvalidRequest

    same = {broker_identity(u) for u in ("postgresql+psycopg://gpu:secret@DB.example/broker?connect_timeout=3",
                                         "postgresql://gpu@db.example:5432/broker")}
    assert same == {"postgresql://gpu@db.example:5432/broker"}
    assert broker_identity("postgresql://gpu@db.example/other") != same.pop()
    monkeypatch.chdir(tmp_path)
    assert broker_identity("sqlite:///b.db") == broker_identity(f"sqlite:///{tmp_path / 'b.db'}")
    # a broker whose registration fails does not keep the host's GPUs from the one that has them
    work_dir = tmp_path / "jobs"
    failing = GpuBroker(f"sqlite:///{tmp_path / 'failing.db'}")
    monkeypatch.setattr(failing, "register_node", lambda *a, **k: (_ for _ in ()).throw(InvalidRequest("refused")))
    with pytest.raises(InvalidRequest):
        LocalBackend(work_dir, failing).ensure_pool("default")
    assert not (work_dir / CLAIM_FILE).exists() and not (tmp_path / "host-claim" / CLAIM_FILE).exists()
    assert LocalBackend(work_dir, GpuBroker(f"sqlite:///{tmp_path / 'real.db'}")).ensure_pool("default")
    with pytest.raises(BackendError, match="real.db"):
        LocalBackend(work_dir, GpuBroker(f"sqlite:///{tmp_path / 'other.db'}")).ensure_pool("default")


def test_two_brokers_registering_a_hosts_real_gpus_at_once_leave_them_in_one(tmp_path, two_real_gpus):
    """Both saw no claim yet and registered the GPUs; the loser raised only afterwards, its
    database holding the host's real GPUs too."""
    work_dir = tmp_path / "jobs"
    brokers = [GpuBroker(f"sqlite:///{tmp_path / f'{i}.db'}") for i in range(2)]
    for b in brokers:
        register = b.register_node
        b.register_node = lambda *a, _register=register, **k: (time.sleep(0.5), _register(*a, **k))[1]
    outcomes: list[str] = []

    def first_run(broker):
        try:
            LocalBackend(work_dir, broker).ensure_pool("default")
            outcomes.append("registered")
        except BackendError:
            outcomes.append("refused")

    threads = [threading.Thread(target=first_run, args=(b,)) for b in brokers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes) == ["refused", "registered"]
    assert sorted(len(b.nodes()) for b in brokers) == [0, 1]


def test_a_claim_lock_held_too_long_is_a_backend_error(tmp_path, two_real_gpus, monkeypatch):
    from airflow_elastic_gpu.backends import local_host

    monkeypatch.setattr(local_host, "CLAIM_LOCK_TIMEOUT_S", 0.5)
    work_dir, held, done = tmp_path / "jobs", threading.Event(), threading.Event()

    def another_broker_registering():
        with local_host.claim_lock():
            held.set()
            done.wait(10)

    threading.Thread(target=another_broker_registering, daemon=True).start()
    assert held.wait(10)
    try:
        with pytest.raises(BackendError, match="which guards this host's GPUs"):
            LocalBackend(work_dir, GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")).ensure_pool("default")
    finally:
        done.set()


def test_nodes_detect_refuses_a_hosts_real_gpus_another_broker_has(tmp_path, two_real_gpus, monkeypatch, capsys):
    """``airflow-elastic-gpu nodes detect`` registered the host's real GPUs in whatever broker it was
    pointed at, without the check a job's start makes: two brokers then handed them out."""
    from airflow_elastic_gpu.cli import main

    work_dir = tmp_path / "jobs"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_WORK_DIR", str(work_dir))
    first, second = (tmp_path / name for name in ("real.db", "fallback.db"))
    assert main(["--broker-url", f"sqlite:///{first}", "nodes", "detect"]) == 0
    capsys.readouterr()
    assert main(["--broker-url", f"sqlite:///{second}", "nodes", "detect"]) != 0
    assert "real.db" in " ".join(capsys.readouterr().err.split())
    other = GpuBroker(f"sqlite:///{second}")
    try:
        assert other.nodes() == []
    finally:
        other.engine.dispose()
    with pytest.raises(BackendError, match="real.db"):  # and a job's start agrees
        LocalBackend(work_dir, GpuBroker(f"sqlite:///{second}")).ensure_pool("default")
