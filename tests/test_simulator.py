"""Simulator, peer policies and workload generator: conservation, determinism, each policy's
characteristic behaviour, broker-in-the-loop equivalence, and clear errors on bad input."""

from __future__ import annotations

import csv
import itertools
import math
from collections import defaultdict

import pytest

from airflow_elastic_gpu.cli import main as cli_main
from airflow_elastic_gpu.scheduling.adaptive import AdaptivePolicy
from airflow_elastic_gpu.scheduling.policy import get_policy, policy_classes
from airflow_elastic_gpu.simulator.engine import (
    ClusterShape,
    RecreateModel,
    RestartOverheads,
    SimulationError,
    SimulationResult,
    simulate,
)
from airflow_elastic_gpu.simulator.profiles import ProfileError, bundled_data, load_profiles
from airflow_elastic_gpu.simulator.results import JobRecord, contention, nearest_rank
from airflow_elastic_gpu.simulator.trace import TraceError, TraceJob, load_trace, write_trace
from airflow_elastic_gpu.simulator.workload import WorkloadError, generate_workload

POLICIES = sorted(policy_classes())
SMALL = [
    TraceJob("a", 0, 1, 3000, "imagenet"),
    TraceJob("b", 130, 2, 2000, "bert"),
    TraceJob("c", 420, 4, 1500, "cifar10"),
    TraceJob("d", 900, 1, 600, "ncf"),
    TraceJob("e", 1000, 8, 900, "deepspeech2"),
]


@pytest.fixture(scope="module")
def workload() -> list[TraceJob]:
    trace = load_trace(bundled_data("itp_cluster02_day27_3d.csv"))
    return generate_workload(trace, gpus=16, hours=8, load=1.0, seed=3)


def held_over_time(result: SimulationResult) -> list[tuple[float, int]]:
    """Total GPUs held after each allocation change, rebuilt from the per-job timeline."""
    held: dict[str, int] = defaultdict(int)
    out = []
    for t, job_id, n in result.allocations:
        held[job_id] = n
        out.append((t, sum(held.values())))
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_conservation_every_job_finishes_all_work_done_capacity_never_exceeded(policy, workload):
    result = simulate(workload, ClusterShape(4, 4), policy, seed=3)
    assert len(result.jobs) == len(workload)
    assert all(j.end_s is not None and j.end_s >= j.submit_s for j in result.jobs)
    assert result.work_done == pytest.approx(sum(j.work for j in result.jobs), rel=1e-9)
    assert max(n for _, n in held_over_time(result)) <= 16
    assert max(n for _, n in result.busy) <= 16
    assert held_over_time(result)[-1][1] == 0
    s = result.summary()
    # nobody beats the lower bound (each job alone at its best speed; capacity-limited makespan)
    assert s["avg_jct_over_bound"] >= 1.0 - 1e-9
    assert s["makespan_over_bound"] >= 1.0 - 1e-9
    assert 0 < s["gpu_utilisation"] <= 1.0 + 1e-9


def test_same_seed_same_schedule_and_seed_changes_model_draw():
    trace = load_trace(bundled_data("philly_vc-ee9e8c_2017-10-23_14d.csv"))
    jobs = [j for j in trace if j.num_gpus <= 16][:20]  # no model column: models are drawn
    a = simulate(jobs, ClusterShape(4, 4), "adaptive", seed=7)
    b = simulate(jobs, ClusterShape(4, 4), "adaptive", seed=7)
    assert a.allocations == b.allocations
    assert [(j.model, j.end_s) for j in a.jobs] == [(j.model, j.end_s) for j in b.jobs]
    models = {seed: [j.model for j in simulate(jobs, ClusterShape(4, 4), "static", seed=seed).jobs]
              for seed in range(4)}
    assert len({tuple(m) for m in models.values()}) > 1
    w1 = generate_workload(trace, gpus=16, seed=5)
    assert w1 == generate_workload(trace, gpus=16, seed=5)
    assert w1 != generate_workload(trace, gpus=16, seed=6)


def test_static_never_resizes_and_serves_in_submit_order_with_backfill():
    trace = [TraceJob("big", 0, 4, 3600, "imagenet"), TraceJob("wide", 10, 4, 600, "imagenet"),
             TraceJob("small", 20, 1, 600, "imagenet")]
    r = simulate(trace, ClusterShape(1, 5), "static")
    jobs = {j.job_id: j for j in r.jobs}
    assert sum(j.resizes + j.preemptions for j in r.jobs) == 0
    assert jobs["small"].queueing_s == 0  # backfilled on the free GPU
    assert jobs["wide"].start_s == pytest.approx(jobs["big"].end_s)  # waits for its request
    assert jobs["big"].jct_s == pytest.approx(3600)  # exactly its recorded duration


def test_adaptive_grows_a_lone_job_and_shrinks_it_for_a_newcomer():
    trace = [TraceJob("long", 0, 1, 20_000, "imagenet"), TraceJob("short", 3000, 1, 1200, "imagenet")]
    r = simulate(trace, ClusterShape(1, 4), "adaptive")
    counts = [(job, n) for _, job, n in r.allocations]
    assert ("long", 4) in counts  # grew onto idle GPUs
    assert any(job == "long" and 0 < n < 4 for job, n in counts[counts.index(("long", 4)):])  # gave some back
    jobs = {j.job_id: j for j in r.jobs}
    # the newcomer waits only for the long job's trainer to stop on the GPUs it gives up
    assert jobs["short"].queueing_s == pytest.approx(RestartOverheads().inplace_stop_s)
    assert jobs["long"].jct_s < 20_000 / 2  # imagenet scales well: far faster than on its 1 GPU


def test_an_in_place_resize_gives_its_gpus_up_only_once_its_trainer_has_stopped():
    """The simulator acked an in-place resize when it was published: a shrinking job's GPUs went to
    another job at once, while only a re-created pod held them through its trainer's stop, a bias
    for in place of the size of the difference between the two mechanisms."""
    trace = [TraceJob("a", 0, 4, 20_000, "imagenet"), TraceJob("b", 600, 1, 1200, "imagenet")]
    starts = {}
    for mechanism in ("inplace", "recreate", "none"):
        overheads = RestartOverheads(inplace_s=7.0, inplace_stop_s=2.5, recreate=RecreateModel(grace_period_s=2.5))
        r = simulate(trace, ClusterShape(1, 4), "adaptive", overheads=overheads, mechanism=mechanism)
        jobs = {j.job_id: j for j in r.jobs}
        starts[mechanism] = jobs["b"].start_s
        first, second = [n for _, job_id, n in r.allocations if job_id == "a"][:2]
        assert first == 4 and second < 4 and jobs["a"].resizes >= 1  # a shrank for b
    assert starts == {"inplace": pytest.approx(602.5), "recreate": pytest.approx(602.5), "none": pytest.approx(600)}
    with pytest.raises(SimulationError, match="inplace_stop_s must be a finite number >= 0"):
        RestartOverheads(inplace_stop_s=-1)
    assert RestartOverheads(inplace_s=1.0, inplace_stop_s=2.5).ack_delay_s("inplace") == 1.0



def test_a_job_that_scales_badly_across_nodes_tries_the_second_node_and_comes_back():
    """yolov3 (Pollux T4 profile) runs 2.6x faster on 4 GPUs of one node but only 1.6x on 8 over two:
    alone on 2 nodes it starts on one node, tries both on idle GPUs once measured on one, and ends
    on one node. Spread over both from the start (its prior), it was never measured on fewer GPUs
    and stayed there."""
    r = simulate([TraceJob("y", 0, 1, 20_000, "yolov3")], ClusterShape(2, 4), "adaptive")
    counts = [n for _, _, n in r.allocations]
    assert counts == [4, 8, 4, 0], counts  # never below its best measured count on a guess
    assert r.jobs[0].jct_s < 20_000 / 2.4  # most of its run on 4 GPUs of one node
    known = simulate([TraceJob("y", 0, 1, 20_000, "yolov3")], ClusterShape(2, 4), "adaptive", known_throughput=True)
    assert [n for _, _, n in known.allocations] == [4, 0]  # the oracle knows: one node, no trial
    assert known.jobs[0].jct_s < r.jobs[0].jct_s
    with pytest.raises(SimulationError, match="known_throughput is for the in-memory scheduler"):
        simulate(SMALL, ClusterShape(2, 4), "adaptive", broker=True, known_throughput=True)


@pytest.mark.parametrize("broker", [False, True])
def test_the_next_run_of_a_training_skips_the_trial_its_last_run_made(broker):
    """The same yolov3 training again after its first run finished: that run's samples (slower on
    two nodes) are its prior, so it stays on one node without trying the second. Broker mode reads
    them from the broker's finished job."""
    trace = [TraceJob("first", 0, 1, 20_000, "yolov3"), TraceJob("next", 10_000, 1, 20_000, "yolov3")]
    r = simulate(trace, ClusterShape(2, 4), "adaptive", broker=broker)
    counts = {j: [n for _, job, n in r.allocations if job == j] for j in ("first", "next")}
    assert counts == {"first": [4, 8, 4, 0], "next": [4, 0]}, counts

def test_tiresias_demotes_a_long_job_and_preempts_it_for_a_new_one():
    trace = [TraceJob("long", 0, 4, 20_000, "imagenet"), TraceJob("new", 3600, 4, 600, "imagenet")]
    r = simulate(trace, ClusterShape(1, 4), "tiresias")
    jobs = {j.job_id: j for j in r.jobs}
    assert jobs["long"].preemptions == 1  # 4 GPUs x 3600 s > the 1 GPU-hour threshold: demoted
    assert jobs["new"].queueing_s < 120
    assert jobs["new"].end_s < jobs["long"].end_s
    static = {j.job_id: j for j in simulate(trace, ClusterShape(1, 4), "static").jobs}
    assert static["new"].start_s == pytest.approx(static["long"].end_s)


def test_termination_pays_recreate_overhead_adaptive_pays_in_place():
    overheads = RestartOverheads(inplace_s=5.0, recreate_s=100.0)
    trace = [TraceJob("long", 0, 1, 20_000, "imagenet"), TraceJob("short", 3000, 1, 1200, "imagenet")]
    a = simulate(trace, ClusterShape(1, 4), "adaptive", overheads=overheads)
    t = simulate(trace, ClusterShape(1, 4), "termination", overheads=overheads)
    assert a.mechanism == "inplace" and t.mechanism == "recreate"
    lost_a = sum(j.restart_lost_s for j in a.jobs) / max(1, sum(j.resizes for j in a.jobs))
    lost_t = sum(j.restart_lost_s for j in t.jobs) / max(1, sum(j.resizes for j in t.jobs))
    assert lost_a == pytest.approx(5.0)
    assert lost_t == pytest.approx(100.0)  # the grace period on the old GPUs, the rest on the new
    forced = simulate(trace, ClusterShape(1, 4), "termination", overheads=overheads, mechanism="inplace")
    assert forced.mechanism == "inplace"


@pytest.mark.parametrize("policy", ["optimus", "afs_l"])
def test_elastic_peers_use_idle_gpus(policy):
    trace = [TraceJob("only", 0, 1, 20_000, "imagenet")]
    r = simulate(trace, ClusterShape(1, 4), policy)
    assert max(n for _, job, n in r.allocations) == 4
    assert r.jobs[0].jct_s < 20_000 / 2


def test_slowdown_and_finish_time_fairness_follow_their_definitions():
    """A job alone has slowdown 1 and rho 1 when it runs at its best speed at once; static gives
    each job its request, so a job whose best count is larger has a slowdown above 1."""
    alone = simulate([TraceJob("a", 0, 4, 3600, "imagenet")], ClusterShape(1, 4), "static").jobs[0]
    assert alone.slowdown == pytest.approx(1.0)
    r = simulate([TraceJob("a", 0, 1, 3600, "imagenet")], ClusterShape(1, 4), "static")
    [(n, rho)] = r.fairness()
    assert n == pytest.approx(1.0)
    assert rho == pytest.approx(r.jobs[0].slowdown) and rho > 1  # 1 GPU of the 4 it could use
    s = r.summary()
    assert s["max_slowdown"] == pytest.approx(rho) and s["share_ftf_rho_above_1"] == 1.0


def test_a_job_of_no_work_has_a_summary():
    """``simulate`` takes jobs from code too (a trace file refuses them): one of no work divided by
    its isolated run time, 0, and the summary raised ZeroDivisionError; one that ended at 0.0 read
    as unfinished (an infinite makespan)."""
    r = simulate([TraceJob("z", 0, 1, 0, "imagenet"), TraceJob("a", 0, 1, 3600, "imagenet")], ClusterShape(1, 4),
                 "static")
    s = r.summary()
    z = next(i for i, j in enumerate(r.jobs) if j.job_id == "z")
    assert r.jobs[z].end_s == 0.0 and s["makespan_s"] == r.jobs[1 - z].end_s and r.fairness()[z][1] == 1.0
    r.jobs[z] = JobRecord("z", "m", 0, 1, 0, 0, start_s=0, end_s=2.0, best_speeds=(1.0,))  # no work, yet it took time
    assert r.fairness()[z][1] == math.inf
    r.jobs[z] = JobRecord("z", "m", 0, 1, 10, 10, start_s=0, best_speeds=(1.0,))  # unfinished: inf, not inf/inf
    assert r.fairness()[z][1] == math.inf and r.summary()["max_ftf_rho"] == math.inf


def test_quantiles_are_nearest_rank():
    assert nearest_rank([3.0, 1.0, 2.0], 0.99) == 3.0  # fewer than 100: the largest
    assert nearest_rank([float(i) for i in range(1, 201)], 0.99) == 198.0  # rank ceil(198) = 198
    assert nearest_rank([float(i) for i in range(1, 47)], 0.99) == 46.0  # not the 45th (int() - 1)
    assert nearest_rank([5.0], 0.5) == 5.0
    with pytest.raises(ValueError, match="no values"):
        nearest_rank([], 0.5)


def test_contention_is_the_time_average_of_jobs_in_the_system():
    jobs = [JobRecord("a", "m", 0, 1, 1, 1, end_s=100), JobRecord("b", "m", 50, 1, 1, 1, end_s=150),
            JobRecord("c", "m", 200, 1, 1, 1, end_s=300)]
    assert contention(jobs) == pytest.approx([1.5, 1.5, 1.0])


def test_isolated_jct_is_linear_between_integer_shares():
    job = JobRecord("a", "m", 0, 1, 1, work=100.0, best_speeds=(1.0, 1.5, 2.0))
    assert job.isolated_jct_s(1) == pytest.approx(100.0)
    assert job.isolated_jct_s(0.5) == pytest.approx(200.0)  # half a GPU: time-shared
    assert job.isolated_jct_s(1.5) == pytest.approx(100 / 1.25)
    assert job.isolated_jct_s(16) == pytest.approx(50.0)  # flat above its largest count


@pytest.mark.parametrize("policy", POLICIES)
def test_tail_and_fairness_metrics_are_consistent(policy, workload):
    s = simulate(workload, ClusterShape(4, 4), policy, seed=3).summary()
    assert s["p50_jct_s"] <= s["p95_jct_s"] <= s["p99_jct_s"]
    assert 1.0 - 1e-9 <= s["avg_slowdown"] <= s["max_slowdown"]
    assert 0 < s["avg_ftf_rho"] <= s["max_ftf_rho"] <= s["max_slowdown"] + 1e-9  # T_id >= ideal
    assert 0 <= s["share_ftf_rho_above_1"] <= 1


def test_broker_mode_refuses_recreation():
    with pytest.raises(SimulationError, match="broker mode cannot simulate termination-based"):
        simulate(SMALL, ClusterShape(2, 4), "termination", broker=True)


@pytest.mark.parametrize("policy", ["adaptive", "static", "termination", "optimus"])
def test_broker_in_the_loop_gives_the_same_schedule(policy):
    """The broker keeps a re-created job's GPUs, so both run every policy with in-place resizes."""
    mechanism = "inplace" if get_policy(policy).resize_mechanism == "recreate" else None
    pure = simulate(SMALL, ClusterShape(2, 4), policy, mechanism=mechanism)
    real = simulate(SMALL, ClusterShape(2, 4), policy, broker=True, mechanism=mechanism)
    assert real.allocations == pure.allocations
    assert [j.end_s for j in real.jobs] == pytest.approx([j.end_s for j in pure.jobs])
    assert real.decisions > 0


def test_profiles_are_node_aware_and_interpolate():
    p = load_profiles()["bert"]
    assert p.samples_per_s(8, 2) < p.samples_per_s(4, 1)  # the source's measured cross-node dip
    assert p.samples_per_s(1) < p.samples_per_s(2) < p.samples_per_s(4)
    six = p.samples_per_s(6, 2)
    assert 0 < six < p.samples_per_s(12, 3)
    assert p.samples_per_s(8, 1) > p.samples_per_s(4, 1)  # one 8-GPU node: extrapolated, no dip
    gavel = load_profiles(source="gavel", gpu_type="V100")
    assert gavel.source == "gavel" and gavel.profiles


def test_workload_generator_cuts_a_paper_scale_workload():
    trace = load_trace(bundled_data("philly_vc-ee9e8c_2017-10-23_14d.csv"))
    jobs = generate_workload(trace, gpus=16, hours=8, load=1.5, seed=1)
    gpu_s = sum(j.gpu_time_s for j in jobs)
    budget = 1.5 * 16 * 8 * 3600
    assert budget <= gpu_s <= budget + max(j.gpu_time_s for j in jobs)
    assert all(j.num_gpus <= 16 and j.gpu_time_s <= 16 * 3600 for j in jobs)
    assert all(0 <= j.submit_time_s < 8 * 3600 for j in jobs)
    assert [j.job_id for j in jobs] == [str(i) for i in range(len(jobs))]
    for j in jobs:  # a model by GPU-time, as the Pollux generator does
        hours = j.gpu_time_s / 3600
        expected = {"cifar10", "ncf"} if hours < 1 else {"deepspeech2", "bert"} if hours < 10 else {"yolov3"}
        assert j.model in expected


def test_cli_workload_and_simulate_write_csvs_and_plots(tmp_path, capsys):
    wl = tmp_path / "w.csv"
    assert cli_main(["workload", "--trace", str(bundled_data("itp_cluster02_day27_3d.csv")),
                     "--gpus", "8", "--hours", "4", "--seed", "2", "--out", str(wl)]) == 0
    assert load_trace(wl)[0].model is not None
    out = tmp_path / "sim"
    assert cli_main(["simulate", "--trace", str(wl), "--cluster", "2x4", "--policy", "adaptive,static",
                     "--out", str(out)]) == 0
    for name in ("summary.csv", "jobs_adaptive.csv", "jobs_static.csv", "jct_cdf.png",
                 "gpus_in_use.png", "timeline_adaptive.png"):
        assert (out / name).stat().st_size > 0, name
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [r["policy"] for r in rows] == ["adaptive", "static"]
    assert (out / "jct_cdf.png").read_bytes()[:4] == b"\x89PNG"
    assert "static: the Kubernetes default scheduler" in " ".join(capsys.readouterr().out.split())


def write_rows(path, header, *rows):
    path.write_text("\n".join([",".join(header), *[",".join(map(str, r)) for r in rows]]) + "\n")
    return path


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([("a", 0, 1)], "missing column"),
        ([("a", 0, 1, 10), ("a", 5, 1, 10)], "job_id 'a' appears twice"),
        ([("a", -1, 1, 10)], "submit_time_s must be >= 0"),
        ([("a", 0, 0, 10)], "num_gpus must be an integer >= 1"),
        ([("a", 0, 1.5, 10)], "num_gpus must be an integer >= 1"),
        ([("a", 0, 1, 0)], "duration_s must be > 0"),
        ([("a", "soon", 1, 10)], "submit_time_s must be a number"),
        ([("a", 0, 1, "nan")], "duration_s must be finite"),
        ([("a", 1e20, 1, 10)], "submit_time_s must be >= 0 and at most 1e\\+12"),  # the clock stood still
        ([("a", 0, 1, 1e300)], "duration_s must be > 0 and at most 1e\\+08"),  # it never ended
        ([], "no jobs"),
    ],
)
def test_bad_trace_files_name_the_problem(tmp_path, rows, message):
    header = ("job_id", "submit_time_s", "num_gpus") if message == "missing column" else (
        "job_id", "submit_time_s", "num_gpus", "duration_s")
    path = write_rows(tmp_path / "t.csv", header, *rows)
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_bad_simulator_inputs_name_the_problem(tmp_path):
    with pytest.raises(SimulationError, match="NODESxGPUS_PER_NODE"):
        ClusterShape.parse("four")
    with pytest.raises(SimulationError, match=">= 1 node"):
        ClusterShape.parse("0x4")
    with pytest.raises(SimulationError, match="ask for more GPUs than the 1x4 cluster"):
        simulate([TraceJob("x", 0, 8, 10)], ClusterShape(1, 4))
    with pytest.raises(ValueError, match="unknown scheduling policy 'fifo'"):
        simulate(SMALL, ClusterShape(2, 4), "fifo")
    with pytest.raises(ProfileError, match="no pollux/T4 throughput profile for model 'gpt9'"):
        simulate([TraceJob("x", 0, 1, 10, "gpt9")], ClusterShape(1, 4))
    with pytest.raises(ProfileError, match="unknown profile source 'nvidia'"):
        load_profiles(source="nvidia")
    with pytest.raises(SimulationError, match="restart overhead inplace_s"):
        RestartOverheads(inplace_s=-1)
    with pytest.raises(SimulationError, match="mechanism must be one of"):
        simulate(SMALL, ClusterShape(2, 4), mechanism="teleport")
    with pytest.raises(SimulationError, match="cannot read restart overheads"):
        RestartOverheads.from_benchmark(tmp_path / "missing.json")
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(tmp_path / "missing.csv")
    trace = load_trace(bundled_data("itp_cluster02_day27_3d.csv"))
    for kwargs, message in (({"load": 0}, "load must be > 0"), ({"load": float("inf")}, "at most 100, got inf"),
                            ({"max_gpu_hours": float("inf")}, "max_gpu_hours must be a finite number > 0"), ({"hours": 30}, "hours must be in"),
                            ({"gpus": 0}, "gpus must be an integer"),
                            ({"max_gpu_hours": 0.001}, "no job of the trace")):
        with pytest.raises(WorkloadError, match=message):
            generate_workload(trace, **kwargs)
    assert cli_main(["simulate", "--trace", str(tmp_path / "missing.csv")]) == 2
    # a profile file without the columns, or with an impossible speed (a KeyError or ZeroDivisionError before)
    with pytest.raises(ProfileError, match="not a throughput profile file: no column source"):
        load_profiles(write_rows(tmp_path / "p.csv", ("job_id", "num_gpus"), ("a", 1)))
    profiles = bundled_data("throughput_profiles.csv").read_text().splitlines()
    bad = [profiles[0], profiles[1].rsplit(",", 3)[0] + ",0,1,weak"]  # pollux bert on one GPU at 0 samples/s
    (tmp_path / "zero.csv").write_text("\n".join(bad) + "\n")
    with pytest.raises(ProfileError, match=r"zero.csv, line 2: num_gpus must be an integer >= 1 and samples_per_s a "
                                           r"finite number > 0, got '1' and '0'"):
        load_profiles(tmp_path / "zero.csv")


def test_preemptive_policies_are_refused_by_the_broker():
    from airflow_elastic_gpu.broker.service import GpuBroker
    from airflow_elastic_gpu.broker.types import InvalidRequest

    broker = GpuBroker("sqlite://")
    broker.register_node("n0", 4)
    for name in ("tiresias", "afs_l"):
        with pytest.raises(InvalidRequest, match="preempts running jobs"):
            broker.configure_pool(policy=name)
    for name in ("adaptive", "static", "termination", "optimus"):
        broker.configure_pool(policy=name)
        assert broker.pool_policy().name == name
    assert get_policy("afs_l").preemptive and not get_policy("adaptive").preemptive


def test_bundled_traces_round_trip(tmp_path):
    jobs = load_trace(bundled_data("philly_vc-ee9e8c_2017-10-23_14d.csv"))
    assert len(jobs) == 302 and all(math.isfinite(j.duration_s) for j in jobs)
    again = load_trace(write_trace(tmp_path / "copy.csv", jobs))
    assert [(j.job_id, j.num_gpus, j.duration_s) for j in again] == [
        (j.job_id, j.num_gpus, j.duration_s) for j in jobs]


@pytest.mark.parametrize(("shortest_h", "longest_h"), [(2.0, 7.0), (0.28, 8.0), (0.01, 400.0)])
def test_jct_cdf_x_labels_do_not_overlap(shortest_h, longest_h, monkeypatch, tmp_path):
    """Whatever the JCT range (within a decade, across two, over many), the x tick labels are apart."""
    from airflow_elastic_gpu.simulator import report

    ratio = (longest_h / shortest_h) ** (1 / 11)
    jobs = [TraceJob(str(i), i, 1, 3600 * shortest_h * ratio**i, "ncf") for i in range(12)]
    results = [simulate(jobs, ClusterShape(4, 4), "static", seed=0)]
    figures = []
    monkeypatch.setattr(report, "_save", lambda plt, fig, path: figures.append(fig) or fig.tight_layout())
    report.plot_jct_cdf(results, tmp_path / "cdf.png")
    [fig] = figures
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    boxes = sorted((t.get_window_extent(renderer) for t in ax.get_xticklabels(minor=False) + ax.get_xticklabels(minor=True)
                    if t.get_text() and t.get_visible()
                    and ax.get_xlim()[0] <= t.get_position()[0] <= ax.get_xlim()[1]), key=lambda b: b.x0)
    assert len(boxes) >= 2
    assert all(a.x1 <= b.x0 for a, b in itertools.pairwise(boxes)), [(b.x0, b.x1) for b in boxes]


def test_a_burst_of_a_measured_training_finishes_sooner_started_shortest_first():
    """Four runs of one training arrive together on 4 GPUs, after an earlier run measured it.
    Admitted all at once they share the GPUs one each, like a processor-sharing queue, and all
    finish near the end; started by gain, one or two at a time on more GPUs each, shortest first:
    a much lower average JCT, a last finish within a few per cent."""
    trace = [TraceJob("first", 0, 1, 600, "bert")] + [
        TraceJob(f"b{i}", 1000, 1, 2400 + 300 * i, "bert") for i in range(4)]
    by_gain = simulate(trace, ClusterShape(1, 4), AdaptivePolicy(admission_by_gain=True))
    at_once = simulate(trace, ClusterShape(1, 4), AdaptivePolicy(admission_by_gain=False))
    assert by_gain.summary()["avg_jct_s"] < 0.8 * at_once.summary()["avg_jct_s"]
    assert max(n for _, job, n in by_gain.allocations if job == "b0") == 4
    assert by_gain.summary()["makespan_s"] <= 1.05 * at_once.summary()["makespan_s"]


def test_a_workload_cut_for_a_mixed_cluster_runs_on_it(tmp_path, capsys):
    """workload --cluster with GPU types draws the models among those measured on every type and
    sizes the workload to the cluster; a workload with a model some type lacks is refused with the
    command that fixes it."""
    from airflow_elastic_gpu.simulator.mixed import MixedCluster, load_typed_profiles

    spec = "2x4:V100,2x4:K80"
    common = set(load_typed_profiles(MixedCluster.parse(spec)).profiles)
    wl = tmp_path / "mixed.csv"
    assert cli_main(["workload", "--trace", str(bundled_data("itp_cluster02_day27_3d.csv")), "--hours", "4",
                     "--cluster", spec, "--out", str(wl)]) == 0
    jobs = load_trace(wl)
    assert jobs and {j.model for j in jobs} <= common and max(j.num_gpus for j in jobs) <= 16
    assert cli_main(["simulate", "--trace", str(wl), "--cluster", spec, "--policy", "adaptive,gavel"]) == 0
    bad = write_rows(tmp_path / "bad.csv", ("job_id", "submit_time_s", "num_gpus", "duration_s", "model"),
                     (0, 0, 1, 600, "yolov3"))
    capsys.readouterr()
    assert cli_main(["simulate", "--trace", str(bad), "--cluster", spec]) == 2
    assert f"workload --cluster {spec}" in " ".join(capsys.readouterr().err.split())


def test_slow_recreations_do_not_make_two_jobs_take_gpus_from_each_other_for_ever():
    """On this workload, with re-creations of 300 s (1.9 s of termination), two jobs of the
    termination peer were re-created 14,533 times each, each placement undone 60 s later (the
    minimum interval) before its 298 s start was over: neither trained and the simulated clock ran
    past 15 years. A resize is now kept at least as long as the job's restart overhead."""
    from conftest import REPO

    jobs = load_trace(REPO / "benchmarks" / "results" / "workloads" / "itp-16gpu-load1.5-seed2.csv")
    overheads = RestartOverheads(recreate=RecreateModel(grace_period_s=1.9, total_s=300.0))
    import signal

    def livelock(*_):
        raise TimeoutError(f"the simulation of {len(jobs)} jobs did not end in 60 s of wall time")

    previous = signal.signal(signal.SIGALRM, livelock)
    signal.alarm(60)  # it takes under a second
    try:
        result = simulate(jobs, ClusterShape(4, 4), "termination", seed=2, overheads=overheads)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert all(r.end_s is not None for r in result.jobs)
    assert result.summary()["makespan_s"] < 30 * 3600
    assert max(r.resizes + r.preemptions for r in result.jobs) < 50
