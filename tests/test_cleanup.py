"""``cleanup``: the job and checkpoint directories of jobs that ended long ago are removed; those of
active jobs, of recent ones, of jobs the broker does not know, and a checkpoint a new try claimed
meanwhile are kept."""

from __future__ import annotations

import uuid

import pytest

from airflow_elastic_gpu.backends import local_cleanup
from airflow_elastic_gpu.broker.types import JobSpec

DAY = 86400.0


def make_dir(path, size=1000):
    path.mkdir(parents=True)
    (path / "data.bin").write_bytes(b"x" * size)
    return path


@pytest.fixture
def work(broker, clock, tmp_path):
    """A work dir: an old success (job dir, renamed checkpoint), an old failure (job dir, checkpoint
    it owns), a running job's and a recent success's directories, an unknown job's, other files."""
    broker.register_node("n0", 4)
    work = tmp_path / "jobs"
    jobs = {k: broker.submit(JobSpec(k, "python train.py", 1, 1, total_steps=10, key=k)) for k in
            ("old-ok", "old-failed", "running", "recent")}
    broker.finish(jobs["old-ok"].id)
    broker.fail(jobs["old-failed"].id, "trainer exited with code 1", 1)
    clock.advance(15 * DAY)
    broker.heartbeat(jobs["running"].id)  # its agent is alive
    broker.finish(jobs["recent"].id)
    for k, job in jobs.items():
        make_dir(work / job.id)
        ckpt = work / "checkpoints" / f"{k}-0123456789ab"
        if k in ("old-ok", "recent"):
            make_dir(ckpt.with_name(f"{ckpt.name}@{job.id}"), 5000)
        else:
            make_dir(ckpt, 3000)
            ckpt.with_name(f"{ckpt.name}.owner").write_text(job.id)
    jobs["unknown"] = make_dir(work / str(uuid.uuid4()))  # another broker's job
    make_dir(work / "notes")
    make_dir(work / "checkpoints" / "by-hand")  # never claimed
    return work, jobs


def test_only_directories_of_jobs_that_ended_long_enough_ago_are_listed_and_removed(broker, work):
    work, jobs = work
    found = local_cleanup.leftovers(broker, work, 14 * DAY)
    listed = {(f.path.name, f.kind, f.job.id) for f in found}
    ok, failed = jobs["old-ok"].id, jobs["old-failed"].id
    assert listed == {(ok, "job directory", ok), (failed, "job directory", failed),
                      (f"old-ok-0123456789ab@{ok}", "checkpoint of a success", ok),
                      ("old-failed-0123456789ab", "checkpoint", failed)}
    assert {f.size_bytes for f in found} == {1000, 5000, 3000}
    assert all(f.age_s == pytest.approx(15 * DAY) for f in found)
    for f in found:
        assert local_cleanup.remove(f)
    assert {p.name for p in work.iterdir()} == {jobs["running"].id, jobs["recent"].id, jobs["unknown"].name,
                                                "checkpoints", "notes"}
    assert not (work / "checkpoints" / "old-failed-0123456789ab.owner").exists()
    assert sorted(p.name for p in (work / "checkpoints").iterdir()) == [
        ".lock", "by-hand", f"recent-0123456789ab@{jobs['recent'].id}", "running-0123456789ab", "running-0123456789ab.owner"]
    assert len(local_cleanup.leftovers(broker, work, 0.0)) == 2  # the recent success's two


def test_a_checkpoint_claimed_by_a_new_try_since_it_was_listed_is_kept(broker, work):
    work, _ = work
    (item,) = [f for f in local_cleanup.leftovers(broker, work, 14 * DAY) if f.kind == "checkpoint"]
    item.path.with_name(f"{item.path.name}.owner").write_text(str(uuid.uuid4()))  # the retry's job
    assert local_cleanup.remove(item) is False and (item.path / "data.bin").exists()


def test_a_claim_during_a_removal_waits_for_it_and_starts_anew(broker, work, monkeypatch):
    """A new try claims the task's checkpoint directory while cleanup removes it: the claim takes
    effect either before the removal's check (kept, above) or after the directory is out of the
    way; the new owner record is never deleted with the old directory, nor written into it."""
    import threading

    from airflow_elastic_gpu.backends import local_checkpoints

    work, _ = work
    (item,) = [f for f in local_cleanup.leftovers(broker, work, 14 * DAY) if f.kind == "checkpoint"]
    retry = str(uuid.uuid4())
    rmtree = local_cleanup.shutil.rmtree

    def rmtree_racing_a_claim(path, *args, **kwargs):
        claimer = threading.Thread(target=local_checkpoints.claim, args=(item.path, retry, lambda _: False, 5.0))
        claimer.start()
        claimer.join(10)
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(local_cleanup.shutil, "rmtree", rmtree_racing_a_claim)
    assert local_cleanup.remove(item)
    assert item.path.with_name(f"{item.path.name}.owner").read_text() == retry
    assert not (item.path / "data.bin").exists()  # the retry starts from step 0, in a directory of its own
    assert [p.name for p in item.path.parent.iterdir() if p.name.endswith(".removing")] == []


def test_a_claim_whose_owner_record_a_removal_takes_as_it_reads_it_starts_anew(tmp_path, monkeypatch):
    """The owner record goes (a cleanup's removal, a rename after a success) between a claim's
    look and its read: the claim takes the directory as unowned instead of failing the start."""
    from pathlib import Path

    from airflow_elastic_gpu.backends import local_checkpoints

    path = make_dir(tmp_path / "checkpoints" / "k-0123456789ab")
    owner = path.with_name(f"{path.name}.owner")
    owner.write_text(str(uuid.uuid4()))
    read = Path.read_text
    removals = []

    def read_racing_a_removal(self, *args, **kwargs):
        if self == owner and not removals:  # the first read: the record goes just before it
            removals.append(self)
            owner.unlink()
        return read(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_racing_a_removal)
    retry = str(uuid.uuid4())
    assert local_checkpoints.claim(path, retry, lambda _: False, 1.0) == path
    assert removals and owner.read_text() == retry


def test_a_removal_interrupted_before_its_rmtree_is_listed_and_finished_later(broker, work, monkeypatch):
    work, jobs = work
    (item,) = [f for f in local_cleanup.leftovers(broker, work, 14 * DAY) if f.kind == "checkpoint"]

    def killed(path, *args, **kwargs):
        raise KeyboardInterrupt  # the cleanup stopped between the rename and the deletion

    monkeypatch.setattr(local_cleanup.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        local_cleanup.remove(item)
    monkeypatch.undo()
    (left,) = [f for f in local_cleanup.leftovers(broker, work, 14 * DAY) if f.kind == "interrupted removal"]
    assert left.job.id == jobs["old-failed"].id and left.size_bytes == 3000
    assert local_cleanup.remove(left) and not left.path.exists()


def test_a_job_whose_processes_still_stop_is_not_listed(broker, work):
    """--older-than 0 right after a cancel: its trainer may still write its last checkpoint."""
    work, jobs = work
    stopping = jobs["old-failed"].id
    found = local_cleanup.leftovers(broker, work, 0.0, is_running=lambda job_id: job_id == stopping)
    assert found and all(f.job.id != stopping for f in found)


def test_a_negative_age_is_refused(broker, tmp_path):
    with pytest.raises(ValueError, match="number of days >= 0"):
        local_cleanup.leftovers(broker, tmp_path, -1.0)


def test_the_cli_lists_with_dry_run_then_removes(tmp_path, monkeypatch, capsys):
    from airflow_elastic_gpu.broker.service import GpuBroker
    from airflow_elastic_gpu.cli import main

    url = f"sqlite:///{tmp_path / 'b.db'}"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", url)
    broker = GpuBroker(url)
    broker.register_node("n0", 1)
    job = broker.submit(JobSpec("train", "python train.py", 1, 1, total_steps=10))
    broker.finish(job.id)
    work = tmp_path / "jobs"
    make_dir(work / job.id, 2 * 2**20)
    assert main(["cleanup", "--older-than", "1", "--work-dir", str(work)]) == 0
    assert "nothing to remove" in capsys.readouterr().out and (work / job.id).exists()
    assert main(["cleanup", "--older-than", "0", "--dry-run", "--work-dir", str(work)]) == 0
    out = capsys.readouterr().out
    assert "would remove" in out and job.id[:8] in out and "would free 2.0 MiB in 1 directories" in out
    assert (work / job.id).exists()
    assert main(["cleanup", "--older-than", "0", "--work-dir", str(work)]) == 0
    assert "freed 2.0 MiB in 1 directories" in capsys.readouterr().out and not (work / job.id).exists()
    assert main(["cleanup", "--older-than", "0", "--work-dir", str(tmp_path / "jbos")]) == 2  # mistyped
    assert f"--work-dir {tmp_path / 'jbos'} is not a directory" in " ".join(capsys.readouterr().err.split())
    with pytest.raises(SystemExit):
        main(["cleanup", "--older-than", "-2"])
    assert "a number of days from 0 to 36500, got '-2'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # in seconds it overflowed, and the error read "got inf"
        main(["cleanup", "--older-than", "1e308"])
    assert "a number of days from 0 to 36500, got '1e308'" in capsys.readouterr().err


def test_a_directory_the_cli_cannot_remove_is_named_and_the_others_are_removed(tmp_path, monkeypatch, capsys):
    """One OSError stopped the whole command with ``error: [Errno 16] Device or resource busy: 'mnt'``:
    neither the directory nor those already removed were named, and the rest were not tried."""
    import shutil

    from airflow_elastic_gpu.broker.service import GpuBroker
    from airflow_elastic_gpu.cli import main

    url = f"sqlite:///{tmp_path / 'b.db'}"
    monkeypatch.setenv("AIRFLOW_ELASTIC_GPU_BROKER_URL", url)
    broker = GpuBroker(url)
    broker.register_node("n0", 1)
    jobs = [broker.submit(JobSpec(f"t{i}", "python train.py", 1, 1, total_steps=10, key=f"k{i}")) for i in range(3)]
    work = tmp_path / "jobs"
    for job in jobs:
        broker.finish(job.id)
        make_dir(work / job.id, 2**20)
    busy = work / jobs[1].id
    real = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if path == busy:
            raise OSError(16, "Device or resource busy", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    assert main(["cleanup", "--older-than", "0", "--work-dir", str(work)]) == 1
    captured = capsys.readouterr()
    assert "freed 2.0 MiB in 2 directories" in captured.out
    assert f"could not remove {busy}: Device or resource busy" in " ".join(captured.err.split())
    assert sorted(p.name for p in work.iterdir()) == [jobs[1].id]
    broker.engine.dispose()
