"""What the CLI prints: help text for every option, tables at full width in files and pipes, and the
names it gives jobs."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from airflow_elastic_gpu.broker.service import GpuBroker
from airflow_elastic_gpu.broker.types import JobSpec
from airflow_elastic_gpu.cli import build_parser, job_name_from_command


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


@pytest.mark.parametrize("command", ["run-local", "simulate", "workload", "nodes", "pool", "jobs", "status",
                                     "cancel", "broker", "cleanup"])
def test_every_option_of_a_command_has_help_text(command):
    parser = subcommands(build_parser())[command]
    missing = [a.option_strings or a.dest for a in parser._actions if not a.help]
    assert missing == []


def test_top_level_help_is_plain_text_without_rest_markup(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    assert "run-local" in text and "simulate" in text
    for markup in ("``", ":func:", ":class:", "~airflow_elastic_gpu"):
        assert markup not in text


@pytest.mark.parametrize(("command", "name"), [
    (("python -m torch.distributed.run --standalone --nproc_per_node={num_gpus} examples/train_digits.py "
      "--total-steps 600"), "train_digits"),
    ("torchrun --nproc_per_node=2 /data/jobs/resnet50.py --epochs 90", "resnet50"),
    ("python3 -u ./finetune.py", "finetune"),
    ("python -m my_project.train --lr 0.1", "train"),
    ("./run_training.sh --fast", "run_training.sh"),
    ("sleep 1000", "sleep"),
])
def test_run_local_names_a_job_after_its_script_not_the_interpreter(command, name):
    assert job_name_from_command(command) == name


def test_tables_written_to_a_pipe_are_not_cut_to_80_columns(tmp_path):
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    broker = GpuBroker(url)
    broker.register_node("n0", 2)
    long_name = "a-job-with-a-name-long-enough-that-an-80-column-table-would-fold-or-cut-it"
    broker.submit(JobSpec(long_name, "sleep 1", 1, 2, total_steps=1_000_000))
    out = subprocess.run([sys.executable, "-m", "airflow_elastic_gpu.cli", "--broker-url", url, "jobs"],
                         capture_output=True, text=True, timeout=60, check=True,
                         env={k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")})
    rows = [line for line in out.stdout.splitlines() if long_name in line]
    assert len(rows) == 1, out.stdout  # the name on one line, whole
    assert "0/1,000,000" in rows[0] and len(rows[0]) > 80
    assert "job files in" in out.stderr  # where it reads and writes, on stderr


def test_pool_params_from_the_command_line_keep_their_types(tmp_path, monkeypatch, capsys):
    from airflow_elastic_gpu.cli import main

    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", f"sqlite:///{tmp_path / 'b.db'}")
    assert main(["nodes", "add", "n1", "--gpus", "2"]) == 0
    assert main(["pool", "--param", "suspend=true", "--param", "max_suspensions_per_hour=3",
                 "--param", "hysteresis=1.5"]) == 0
    out = capsys.readouterr().out
    assert "suspend=True" in out and "max_suspensions_per_hour=3," in out and "hysteresis=1.5" in out


def test_a_bare_pool_shows_the_settings_and_changes_nothing(tmp_path, monkeypatch, capsys):
    from airflow_elastic_gpu.cli import main

    url = f"sqlite:///{tmp_path / 'b.db'}"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", url)
    assert main(["nodes", "add", "n1", "--gpus", "2"]) == 0
    assert main(["pool", "--lease-s", "90"]) == 0
    events = len(GpuBroker(url).events())
    capsys.readouterr()
    assert main(["pool"]) == 0
    assert "lease 90 s; rebalance every 10 s" in capsys.readouterr().out
    assert len(GpuBroker(url).events()) == events  # no config event, no rebalance
    for value in ("inf", "nan", "1e999"):
        assert main(["pool", "--param", f"hysteresis={value}"]) == 2
        assert "the value of hysteresis must be a finite number" in capsys.readouterr().err
    with pytest.raises(Exception, match="policy parameter hysteresis must be a finite number"):
        GpuBroker(url).configure_pool(policy_params={"hysteresis": float("inf")})


def test_each_pool_param_call_adds_to_the_parameters_set_before(tmp_path, monkeypatch, capsys):
    """The README sets pool parameters one call at a time (suspension, then admission): a later
    `pool --param` keeps the earlier ones; another --policy starts from its own defaults."""
    from airflow_elastic_gpu.cli import main

    url = f"sqlite:///{tmp_path / 'b.db'}"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", url)
    assert main(["nodes", "add", "n1", "--gpus", "2"]) == 0
    assert main(["pool", "--param", "suspend=true"]) == 0
    assert main(["pool", "--param", "admission_by_gain=false", "--lease-s", "90"]) == 0
    broker = GpuBroker(url)
    assert broker.pool_settings() == ("adaptive", {"suspend": True, "admission_by_gain": False})
    assert broker.pool_policy().suspend and not broker.pool_policy().admission_by_gain
    assert main(["pool", "--policy", "adaptive", "--param", "hysteresis=1"]) == 0  # the same policy: kept
    assert broker.pool_settings()[1] == {"suspend": True, "admission_by_gain": False, "hysteresis": 1}
    assert main(["pool", "--policy", "adaptive", "--rebalance-interval-s", "20"]) == 0
    assert broker.pool_settings()[1] == {"suspend": True, "admission_by_gain": False, "hysteresis": 1}
    assert main(["pool", "--policy", "static"]) == 0  # another policy: its defaults
    assert broker.pool_settings() == ("static", {})
    broker.engine.dispose()
    capsys.readouterr()


def test_nodes_list_shows_the_pool_it_is_given(tmp_path, monkeypatch, capsys):
    from airflow_elastic_gpu.cli import main

    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", f"sqlite:///{tmp_path / 'b.db'}")
    assert main(["nodes", "add", "a-node", "--gpus", "2"]) == 0
    assert main(["nodes", "add", "b-node", "--gpus", "2", "--pool", "other"]) == 0
    capsys.readouterr()
    assert main(["nodes", "list", "--pool", "other"]) == 0
    out = capsys.readouterr().out
    assert "b-node" in out and "a-node" not in out
    assert main(["nodes"]) == 0
    out = capsys.readouterr().out
    assert "a-node" in out and "b-node" in out
    assert main(["nodes", "list", "--pool", "nope"]) != 0
    assert "unknown GPU pool 'nope'; known pools: default, other" in capsys.readouterr().err
    assert main(["nodes", "list", "b-node"]) == 0  # a name: that node only (it was ignored)
    out = capsys.readouterr().out
    assert "b-node" in out and "a-node" not in out
    assert main(["nodes", "list", "a-node", "--pool", "other"]) != 0
    assert "unknown node 'a-node' in pool 'other'" in capsys.readouterr().err


def test_names_and_messages_with_brackets_are_printed_as_they_are(tmp_path, monkeypatch, capsys):
    """A trainer's error ``[rank0]: ... [/data/ckpt] ...`` and a job named ``train[0] [bold]x`` are
    text, not rich markup: nothing is dropped and nothing crashes (an unmatched closing tag raised
    a MarkupError from ``status`` for as long as the event was among the last ten)."""
    from airflow_elastic_gpu.cli import main

    url = f"sqlite:///{tmp_path / 'b.db'}"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", url)
    monkeypatch.setenv("COLUMNS", "400")
    broker = GpuBroker(url)
    broker.register_node("n[1]", 2)
    job = broker.submit(JobSpec("train[0] [bold]x", "sleep 1", 1, 2, total_steps=10))
    reason = "[rank0]: RuntimeError: checkpoint dir [/data/ckpt] not writable"
    broker.fail(job.id, reason)
    broker.engine.dispose()
    capsys.readouterr()
    assert main(["jobs"]) == 0
    assert "train[0] [bold]x" in capsys.readouterr().out
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert reason in out and "train[0] [bold]x" in out and "n[1]" in out
    assert main(["nodes"]) == 0
    assert "n[1]" in capsys.readouterr().out



@pytest.mark.parametrize(("accuracy", "shown"), [(0.93127, "0.931"), ("0.93", "0.93"), ([0.9, 0.8], "[0.9, 0.8]"),
                                                 ({"top1": 0.9, "top5": 0.99}, "{'top1': 0.9, 'top5…"),
                                                 (True, "True")])
def test_a_metric_that_is_not_a_number_is_shown_not_fatal(tmp_path, monkeypatch, capsys, accuracy, shown):
    """The API takes any JSON metric; ``jobs`` and ``status`` list every job, so one job whose
    trainer printed its accuracy as a string broke both for good."""
    from airflow_elastic_gpu.cli import main

    url = f"sqlite:///{tmp_path / 'b.db'}"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", url)
    monkeypatch.setenv("COLUMNS", "400")
    broker = GpuBroker(url)
    broker.register_node("n0", 1)
    broker.finish(broker.submit(JobSpec("train", "python train.py", 1, 1, total_steps=10)).id, 0,
                  {"accuracy": accuracy})
    capsys.readouterr()
    assert main(["jobs"]) == 0
    assert shown in capsys.readouterr().out
    assert main(["status"]) == 0


def test_the_cli_uses_the_configured_default_pool(tmp_path, monkeypatch, capsys):
    """``[elastic_gpu] default_pool`` in airflow.cfg is the pool of nodes add, pool, status and
    run-local when --pool is not given, as for the operator."""
    from airflow_elastic_gpu.cli import main

    (tmp_path / "airflow.cfg").write_text(
        f"[elastic_gpu]\nbroker_url = sqlite:///{tmp_path / 'b.db'}\ndefault_pool = team-a\n")
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    for name in ("AIRFLOW_CONFIG", "AIRFLOW_ELASTIC_GPU_BROKER_URL", "AIRFLOW__ELASTIC_GPU__BROKER_URL",
                 "AIRFLOW__ELASTIC_GPU__DEFAULT_POOL"):
        monkeypatch.delenv(name, raising=False)
    assert main(["nodes", "add", "n1", "--gpus", "2"]) == 0
    assert main(["pool", "--param", "hysteresis=1"]) == 0
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "pool 'team-a': policy" in out and "GPU pool 'team-a'" in out
    broker = GpuBroker(f"sqlite:///{tmp_path / 'b.db'}")
    assert broker.pools() == ["team-a"] and broker.pool_settings("team-a") == ("adaptive", {"hysteresis": 1})
    broker.engine.dispose()


@pytest.mark.parametrize("interval", ["-1", "0", "nan", "soon"])
def test_status_refuses_an_interval_that_is_not_a_positive_number(interval, capsys):
    from airflow_elastic_gpu.cli import main

    with pytest.raises(SystemExit):
        main(["status", "--watch", "--interval", interval])
    assert "argument --interval: must be a number of seconds" in capsys.readouterr().err


def test_status_says_its_interval_needs_watch_and_the_cli_its_version(tmp_path, monkeypatch, capsys):
    from importlib.metadata import version

    from airflow_elastic_gpu.cli import main

    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", f"sqlite:///{tmp_path / 'b.db'}")
    assert main(["status", "--interval", "2"]) == 2  # it was taken and ignored
    assert "--interval goes with --watch" in capsys.readouterr().err
    assert main(["status", "--watch", "--interval", "1e-7"]) == 2  # a busy loop on the database
    assert "--interval must be at least 0.2 seconds, got 1e-07" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"airflow-elastic-gpu {version('airflow-elastic-gpu')}"


def test_cancel_takes_the_start_of_an_id_as_jobs_shows_it(tmp_path, monkeypatch, capsys):
    from airflow_elastic_gpu.cli import main

    url = f"sqlite:///{tmp_path / 'b.db'}"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", url)
    broker = GpuBroker(url)
    broker.register_node("n0", 2)
    job = broker.submit(JobSpec("train", "sleep 1", 1, 1, total_steps=10))
    capsys.readouterr()
    assert main(["cancel", "ffffffff-no-such-job"]) == 2
    assert "unknown job 'ffffffff-no-such-job': no job has this id" in capsys.readouterr().err
    assert main(["cancel", job.id[:8]]) == 0
    assert f"job {job.id} is cancelled" in capsys.readouterr().out
    assert broker.job(job.id).status.value == "cancelled"
    assert main(["cancel", job.id]) == 0  # again: said, not "is cancelled" as if it had been now
    assert f"job {job.id} had already ended (cancelled): nothing to cancel" in capsys.readouterr().out
    assert main(["cancel", job.id[:8]]) == 0  # the start of the one ended job's id: as its whole id (idempotent)
    assert f"job {job.id} had already ended (cancelled): nothing to cancel" in capsys.readouterr().out
    # several active jobs: a start they share is named as ambiguous
    others = [broker.submit(JobSpec(f"t{i}", "sleep 1", 1, 1, total_steps=10)) for i in range(40)]
    first = {}
    for other in others:
        first.setdefault(other.id[0], []).append(other.id)
    shared = next(ids for ids in first.values() if len(ids) > 1)
    assert main(["cancel", shared[0][0]]) == 2
    assert f"jobs' ids start with {shared[0][0]!r}" in capsys.readouterr().err
    assert all(broker.job(i).status.value != "cancelled" for i in shared)
    broker.engine.dispose()


def test_cancel_refuses_the_start_of_an_id_that_an_ended_job_shares_with_an_active_one(tmp_path, monkeypatch,
                                                                                      capsys):
    """``cancel 5`` cancelled the one running job whose id starts with 5, while the user looked at an
    ended job ``546a...`` in ``jobs``."""
    import uuid

    from airflow_elastic_gpu.cli import main

    url = f"sqlite:///{tmp_path / 'b.db'}"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", url)
    broker = GpuBroker(url)
    broker.register_node("n0", 2)
    ids = iter([uuid.UUID("546a3680-0000-4000-8000-000000000000"), uuid.UUID("5b6fe2a4-0000-4000-8000-000000000000")])
    monkeypatch.setattr(uuid, "uuid4", lambda: next(ids))
    ended = broker.submit(JobSpec("ended", "sleep 1", 1, 1, total_steps=10, key="a"))
    broker.cancel(ended.id, "done with it")
    running = broker.submit(JobSpec("running", "sleep 1", 1, 1, total_steps=10, key="b"))
    capsys.readouterr()
    assert main(["cancel", "5"]) == 2
    err = capsys.readouterr().err
    assert f"2 jobs' ids start with '5': {running.id} (running), {ended.id} (cancelled)" in err  # active first
    assert broker.job(running.id).status.value != "cancelled"
    assert main(["cancel", "5b"]) == 0 and broker.job(running.id).status.value == "cancelled"
    broker.engine.dispose()


def test_ctrl_c_and_a_database_of_another_version_end_a_command_with_one_line(tmp_path, monkeypatch, capsys):
    """Both gave a Python traceback (and the database one exit 1)."""
    from sqlalchemy import create_engine, text

    from airflow_elastic_gpu.cli import main

    url = f"sqlite:///{tmp_path / 'b.db'}"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", url)
    GpuBroker(url).register_node("n0", 1)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(GpuBroker, "jobs", interrupted)
        assert main(["jobs"]) == 130
    assert capsys.readouterr().err.strip().endswith("\ninterrupted")
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'abc123'"))
    engine.dispose()
    assert main(["jobs"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "error: the broker database" in err and "revision 'abc123'" in err and "Traceback" not in err


def test_a_reading_command_does_not_write_the_brokers_schema_into_another_database(tmp_path, capsys):
    """``--broker-url sqlite:///other.db jobs`` added the broker's tables to an unrelated file (an
    empty one too) and showed an empty table."""
    import sqlite3

    from airflow_elastic_gpu.cli import main

    other, empty = tmp_path / "other.db", tmp_path / "empty.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE t (x)")
    empty.touch()
    for path in (other, empty):
        assert main(["--broker-url", f"sqlite:///{path}", "jobs"]) == 2
        assert "holds no broker schema" in " ".join(capsys.readouterr().err.split())
    for path, tables in ((other, [("t",)]), (empty, [])):
        with sqlite3.connect(path) as db:
            assert db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall() == tables
    assert main(["--broker-url", f"sqlite:///{other}", "nodes", "add", "n0", "--gpus", "1"]) == 0  # a writer may
    assert main(["--broker-url", f"sqlite:///{other}", "jobs"]) == 0


def test_a_pool_holding_parameters_its_policy_does_not_take_is_repaired_by_the_next_setting(
        tmp_path, monkeypatch, capsys):
    """Before parameters were checked against the pool's own policy, a static pool could store
    adaptive's hysteresis; the next `pool` call drops it (and says so) instead of failing on it."""
    from sqlalchemy import text

    from airflow_elastic_gpu.cli import main

    url = f"sqlite:///{tmp_path / 'b.db'}"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", url)
    broker = GpuBroker(url)
    broker.register_node("n0", 2)
    broker.configure_pool(policy="static")
    with broker.engine.begin() as conn:
        conn.execute(text("UPDATE gpu_pool SET policy_params = :p"), {"p": '{"hysteresis": 1.0}'})
    capsys.readouterr()
    assert main(["pool", "--policy", "static"]) == 0
    assert "dropping parameters that policy 'static' does not take: hysteresis" in capsys.readouterr().err
    assert broker.pool_settings() == ("static", {})
    broker.engine.dispose()


def test_reading_commands_do_not_make_an_empty_broker_where_there_is_none(tmp_path, monkeypatch, capsys):
    """A mistyped $AIRFLOW_HOME: `jobs` showed an empty table (a new SQLite file made on the spot)
    and said nothing; it names the missing database instead, and makes none."""
    from airflow_elastic_gpu.cli import main

    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "airflw"))
    monkeypatch.delenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", raising=False)
    monkeypatch.delenv("AIRFLOW__ELASTIC_GPU__BROKER_URL", raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_ELASTIC_GPU_DEFAULT", "postgresql://somewhere/broker")
    for argv in (["jobs"], ["status"], ["nodes"], ["pool"], ["cancel", "abc"], ["cleanup", "--older-than", "1"]):
        assert main(argv) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"no broker database at {tmp_path / 'airflw' / 'elastic_gpu_broker.db'}" in err
        assert "elastic_gpu_default connection in the environment is read by Airflow's tasks" in err
    assert not (tmp_path / "airflw" / "elastic_gpu_broker.db").exists()
    assert main(["nodes", "add", "n0", "--gpus", "1"]) == 0  # a command that registers makes it
    assert main(["jobs"]) == 0


def test_conn_id_reads_the_broker_url_and_pool_of_the_airflow_connection_tasks_use(tmp_path, monkeypatch, capsys):
    """A deployment that configures the broker in the ``elastic_gpu_default`` connection only: the CLI
    read its own settings instead, and showed another (an empty, or an old demo's) broker."""
    import json

    from airflow_elastic_gpu.cli import main

    url = f"sqlite:///{tmp_path / 'tasks_broker.db'}"
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "airflow"))
    monkeypatch.delenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", raising=False)
    monkeypatch.delenv("AIRFLOW__LOGGING__NAMESPACE_LEVELS", raising=False)  # --conn-id sets it for its read only
    monkeypatch.setenv("AIRFLOW_CONN_ELASTIC_GPU_DEFAULT", json.dumps(
        {"conn_type": "elastic_gpu", "extra": {"url": url, "pool": "a100-pool"}}))
    assert main(["--conn-id", "elastic_gpu_default", "nodes", "add", "gpu-node-1", "--gpus", "2"]) == 0
    assert [(n.name, n.pool) for n in GpuBroker(url).nodes()] == [("gpu-node-1", "a100-pool")]
    capsys.readouterr()
    assert main(["--conn-id", "elastic_gpu_default", "status"]) == 0
    captured = capsys.readouterr()
    assert "a100-pool" in captured.out and "tasks_broker.db" in captured.err
    assert not (tmp_path / "airflow" / "elastic_gpu_broker.db").exists()  # the CLI's own default untouched
    assert "AIRFLOW__LOGGING__NAMESPACE_LEVELS" not in os.environ  # not left to the trainers run-local starts

    assert main(["--conn-id", "no_such_conn", "jobs"]) == 2
    assert "no Airflow connection 'no_such_conn'" in " ".join(capsys.readouterr().err.split())
    assert main(["--conn-id", "elastic_gpu_default", "--broker-url", url, "jobs"]) == 2
    assert "give --broker-url or --conn-id, not both" in capsys.readouterr().err
    monkeypatch.setenv("AIRFLOW_CONN_ELASTIC_GPU_BROKEN", '{"conn_type": "elastic_gpu", "extra": {"url": ')
    assert main(["--conn-id", "elastic_gpu_broken", "jobs"]) == 2  # not "no such connection": it is set
    assert "$AIRFLOW_CONN_ELASTIC_GPU_BROKEN is set but Airflow cannot read" in " ".join(capsys.readouterr().err.split())


def test_status_names_each_gpu_by_its_device_index_where_columns_cannot(tmp_path, monkeypatch, capsys):
    """A host split into virtual nodes (``run-local --virtual-nodes 2``): localhost-1 has GPUs 2 and 3,
    which the grid's columns called "GPU 0" and "GPU 1", while ``nodes drain --gpu`` and the events
    take the device index."""
    from airflow_elastic_gpu.cli import main

    url = f"sqlite:///{tmp_path / 'b.db'}"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", url)
    broker = GpuBroker(url)
    broker.register_node("localhost-0", gpu_indices=[0, 1])
    broker.register_node("localhost-1", gpu_indices=[2, 3])
    broker.set_gpus_healthy("localhost-1", [2], False)
    capsys.readouterr()
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "GPU 0" not in out
    assert [line.count("2: out of service") + line.count("3: free") for line in out.splitlines()
            if line.startswith("│ localhost-1")] == [2]
    assert main(["pool"]) == 0
    shown = capsys.readouterr().out
    assert "policy adaptive (hysteresis=" in shown and "AdaptivePolicy" not in shown and "name=" not in shown


def test_an_empty_pool_says_how_to_register_nodes_under_a_title_on_one_line():
    """The GPU grid of a pool without nodes was one narrow ``node`` column, which folded its title
    over three lines and said nothing of what to do."""
    from rich.console import Console

    from airflow_elastic_gpu.broker.types import PoolSnapshot
    from airflow_elastic_gpu.cli_views import snapshot_view

    console = Console(width=200, record=True)
    console.print(snapshot_view(PoolSnapshot("a100", 0.0, (), ())))
    lines = [line.strip() for line in console.export_text().splitlines()]
    assert lines[0] == "GPU pool 'a100'"
    assert any("none: `airflow-elastic-gpu nodes add NAME --gpus N --pool a100`" in line for line in lines)


def test_jobs_and_status_show_a_trainers_metric_and_a_jobs_name_as_text_not_markup(tmp_path, monkeypatch, capsys):
    """A trainer that reported ``{"accuracy": "[/x]"}`` made rich raise ``MarkupError`` in ``jobs`` and
    ``status`` for as long as the job was listed."""
    from airflow_elastic_gpu.cli import main

    url = f"sqlite:///{tmp_path / 'b.db'}"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", url)
    broker = GpuBroker(url)
    broker.register_node("n0", 2)
    job = broker.submit(JobSpec("[/bold] run", "train", 1, 1, total_steps=10))
    broker.ack(job.id, 1)
    broker.finish(job.id, 0, {"accuracy": "[/x]"})
    capsys.readouterr()
    for argv in (["jobs"], ["status"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "[/x]" in out and "[/bold] run" in out, argv
    broker.engine.dispose()
