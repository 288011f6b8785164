"""The throughput model: prior before measurements, Amdahl fit after."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from airflow_elastic_gpu.scheduling.adaptive import AdaptivePolicy
from airflow_elastic_gpu.scheduling.core import JobBook, SchedulingCore
from airflow_elastic_gpu.scheduling.state import NodeState
from airflow_elastic_gpu.scheduling.throughput import ThroughputModel


def test_prior_is_near_linear_before_any_sample():
    m = ThroughputModel(prior_alpha=0.0, prior_steps_per_s=2.0)
    assert m.steps_per_s(1) == pytest.approx(2.0)
    assert m.speedup(4) == pytest.approx(4.0)


def test_one_measured_count_sets_the_scale_and_keeps_the_prior_shape():
    m = ThroughputModel(prior_alpha=0.1).with_sample(2, 10.0)
    assert m.steps_per_s(2) == pytest.approx(10.0)
    # t(n) = t1 n / (1 + 0.1 (n-1)); t(2)=10 -> t1 = 5.5
    assert m.steps_per_s(1) == pytest.approx(5.5)
    assert m.steps_per_s(4) == pytest.approx(5.5 * 4 / 1.3)


def test_two_counts_fit_amdahl_exactly():
    t1, alpha = 8.0, 0.25
    true = lambda n: t1 * n / (1 + alpha * (n - 1))
    m = ThroughputModel().with_sample(1, true(1)).with_sample(4, true(4))
    for n in (2, 3, 8):
        assert m.steps_per_s(n) == pytest.approx(true(n), rel=1e-9)


def test_no_gain_from_more_gpus_is_learned_as_flat():
    m = ThroughputModel().with_sample(1, 10.0).with_sample(4, 9.0)
    assert m.steps_per_s(8) <= 10.0 + 1e-9
    assert m.steps_per_s(2) == pytest.approx(m.steps_per_s(3))


def test_a_flat_fit_is_no_faster_below_its_fastest_measured_count_than_linear():
    """Measured on 4 and 8 GPUs, slower on 8: the counts below 4 were never measured and are
    predicted at most linear below 4's pace (not as fast as 4), so no policy shrinks the job to
    one GPU on the strength of the flat fit."""
    m = ThroughputModel().with_sample(4, 40.0).with_sample(8, 25.0)
    assert m.steps_per_s(4) == pytest.approx(40.0) and m.steps_per_s(8) == pytest.approx(25.0)
    assert [m.steps_per_s(n) for n in (1, 2, 3)] == pytest.approx([10.0, 20.0, 30.0])
    assert m.steps_per_s(16) == pytest.approx(40.0)  # above it: flat at the best seen


def test_counts_below_the_fastest_measured_one_are_fitted_to_the_samples_up_to_it():
    """Linear from 2 to 4 GPUs on one node, slower on 8 over two nodes (the Pollux T4 profiles'
    shape): the 8-GPU sample is another regime. Fitted with it, 1 GPU came out 1.4x half of 2
    (17.8 steps/s) and the job's marginal gain from a second GPU looked small, so the policy
    shrank the shortest job of the pool to one GPU; from the samples up to 4 alone, 1 and 3 GPUs
    are linear as measured."""
    m = ThroughputModel(((2, 26.0), (4, 52.0), (8, 39.0)))
    assert [m.steps_per_s(n) for n in (1, 2, 3, 4)] == pytest.approx([13.0, 26.0, 39.0, 52.0])
    assert m.steps_per_s(8) == pytest.approx(39.0) and m.steps_per_s(6) < 52.0  # above 4: the fit of all


def test_on_a_pool_of_known_node_size_one_node_s_counts_are_fitted_to_one_node_s_samples():
    """Linear on 1 and 2 GPUs, 8 GPUs over two nodes of 4 much less: fitted with the 8-GPU sample,
    4 GPUs were predicted at 33 steps/s (the profile measures 52); the model that knows the node
    size predicts 1-4 from the samples on one node. The node size survives new samples and scaling."""
    samples = ((1, 13.0), (2, 26.0), (8, 38.0))
    assert ThroughputModel(samples).steps_per_s(4) == pytest.approx(33.2, abs=0.1)
    m = ThroughputModel(samples).on_nodes_of(4)
    assert m.node_gpus == 4 and [m.steps_per_s(n) for n in (3, 4)] == pytest.approx([39.0, 52.0])
    assert m.steps_per_s(8) == pytest.approx(38.0) and m.steps_per_s(6) < 52.0  # across nodes: the fit of all
    assert m.with_sample(2, 26.0).node_gpus == 4 and m.scaled(2.0).node_gpus == 4
    assert m.on_nodes_of(4) is m
    with pytest.raises(ValueError, match="node_gpus"):
        ThroughputModel(node_gpus=-1)


def test_a_model_may_have_three_pieces_one_node_below_the_fastest_count_and_the_rest():
    """Linear on one node of 4, fastest on 8 over two nodes, slower on 16: one node's counts come
    from one node's samples, 5-7 from the samples up to 8, the rest from all samples."""
    m = ThroughputModel(((1, 10.0), (2, 20.0), (8, 60.0), (16, 40.0)), node_gpus=4)
    assert [m.steps_per_s(n) for n in (3, 4)] == pytest.approx([30.0, 40.0])
    assert 40.0 < m.steps_per_s(5) < m.steps_per_s(7) < 60.0
    assert m.best_steps_per_s(1, 16) == pytest.approx(60.0) and m.best_steps_per_s(3, 7) == m.steps_per_s(7)


def test_samples_at_one_count_are_smoothed():
    m = ThroughputModel().with_sample(2, 10.0).with_sample(2, 20.0)
    assert 10.0 < m.steps_per_s(2) < 20.0


@pytest.mark.parametrize("n,t", [(0, 1.0), (1, 0.0), (2, -1.0)])
def test_bad_samples_are_rejected(n, t):
    with pytest.raises(ValueError, match="bad throughput sample"):
        ThroughputModel().with_sample(n, t)


def test_bad_prior_is_rejected():
    with pytest.raises(ValueError, match="prior_alpha"):
        ThroughputModel(prior_alpha=1.0)
    with pytest.raises(ValueError, match="num_gpus"):
        ThroughputModel().steps_per_s(0)
    assert math.isfinite(ThroughputModel().steps_per_s(1000))


def test_a_job_not_yet_measured_gets_its_familys_prior_then_the_pools():
    from airflow_elastic_gpu.scheduling.throughput import with_pool_prior

    fast, slow = ThroughputModel().with_sample(1, 1000.0), ThroughputModel().with_sample(1, 2.0)
    models = {"a": fast, "b": slow, "c": ThroughputModel().with_sample(1, 3.0),
              "new-ncf": ThroughputModel(), "new-bert": ThroughputModel(), "new-other": ThroughputModel(),
              "new-rerun": ThroughputModel()}
    families = {"a": "ncf", "b": "bert", "c": "bert", "new-ncf": "ncf", "new-bert": "bert", "new-rerun": "nightly"}
    out = with_pool_prior(models, families, {"nightly": ThroughputModel().with_sample(1, 40.0),
                                             "ncf": ThroughputModel().with_sample(1, 1.0)})
    assert out["a"] is fast and out["b"] is slow  # measured jobs keep their own model
    assert out["new-ncf"].steps_per_s(1) == pytest.approx(1000.0)  # a measured unfinished one beats history
    assert out["new-bert"].steps_per_s(1) == pytest.approx(3.0)  # the family's median (upper of two)
    assert out["new-rerun"].steps_per_s(1) == pytest.approx(40.0)  # only history knows the family
    assert out["new-other"].steps_per_s(1) == pytest.approx(3.0)  # no family: the pool's median
    # no family: the pool median, as before; no measured job and no history: unchanged
    assert with_pool_prior(models)["new-ncf"].steps_per_s(1) == pytest.approx(3.0)
    empty = {"x": ThroughputModel()}
    assert with_pool_prior(empty, {"x": "f"}) == empty
    last = {"f": ThroughputModel().with_sample(1, 7.0)}
    assert with_pool_prior(empty, {"x": "f"}, last)["x"].steps_per_s(1) == pytest.approx(7.0)


def test_a_prior_says_whether_it_comes_from_the_same_training_or_the_pool_guess():
    from airflow_elastic_gpu.scheduling.throughput import with_pool_prior

    measured = ThroughputModel().with_sample(1, 50.0)
    models = {"a": measured, "b": ThroughputModel(), "c": ThroughputModel(), "d": ThroughputModel()}
    families = {"a": "bert", "b": "bert", "c": "ncf", "d": "cifar"}
    out = with_pool_prior(models, families, history={"ncf": ThroughputModel().with_sample(1, 900.0)})
    assert out["a"] is measured and out["a"].from_own_training
    # the family's measured job: its samples (one count here, as good as a single-GPU speed)
    assert (out["b"].observed, out["b"].prior_source, out["b"].own_observed) == (((1, 50.0),), "family", ())
    assert (out["c"].observed, out["c"].prior_source) == (((1, 900.0),), "family")
    assert (out["d"].prior_steps_per_s, out["d"].prior_source) == (50.0, "pool")
    assert out["b"].from_own_training and out["c"].from_own_training and not out["d"].from_own_training
    assert out["d"] == ThroughputModel(prior_steps_per_s=50.0), "the source is not part of the model's value"
    assert out["c"].scaled(2.0).prior_source == "family"


def test_a_training_never_measured_is_guessed_in_time_not_in_steps():
    """With the jobs' remaining steps, a job of a training nobody measured is assumed to have at
    most as much single-GPU time left as the measured job at the pool's lower quartile (here 400 s
    of 100, 400, 900 and 1,600 s), whatever its steps are worth: a million steps of a fast training
    are not ranked as 1,000 times a slow training's thousand. The shorter of that and its steps at
    the pool's median speed counts. The jobs of one such training share one speed (their median
    job's), so they keep their order by steps. A family's prior is not a guess and stays; no
    measured job with steps left: the pool's median speed, as without remaining steps."""
    from airflow_elastic_gpu.scheduling.throughput import with_pool_prior

    models = {f"m{i}": ThroughputModel().with_sample(1, 10.0) for i in range(4)}
    models |= {"done": ThroughputModel().with_sample(1, 10.0), "new-big": ThroughputModel(),
               "new-small": ThroughputModel(), "rerun": ThroughputModel(), "x1": ThroughputModel(),
               "x30": ThroughputModel()}
    remaining = {"m0": 1000.0, "m1": 4000.0, "m2": 9000.0, "m3": 16000.0, "done": 0.0,
                 "new-big": 1_000_000.0, "new-small": 1000.0, "rerun": 500.0, "x1": 1000.0, "x30": 30000.0}
    families = {"rerun": "nightly", "new-big": "ncf", "new-small": "bert", "x1": "x", "x30": "x"}
    out = with_pool_prior(models, families, {"nightly": ThroughputModel().with_sample(1, 2.0)}, remaining)

    def left_s(job):
        return remaining[job] / out[job].steps_per_s(1)

    assert left_s("new-big") == pytest.approx(400.0)  # the lower quartile, not 100,000 s at 10 steps/s
    assert left_s("new-small") == pytest.approx(100.0)  # its steps at the median speed: shorter
    assert left_s("x30") == pytest.approx(400.0)  # the median of its training's two guessed jobs
    assert left_s("x1") == pytest.approx(400.0 / 30)  # the same speed: a thirtieth of x30's steps
    for job in ("new-big", "new-small", "x1", "x30"):
        assert out[job].prior_source == "pool" and not out[job].from_own_training
    assert out["rerun"].steps_per_s(1) == pytest.approx(2.0) and out["rerun"].prior_source == "family"
    assert all(out[f"m{i}"] is models[f"m{i}"] for i in range(4))
    # no measured job with steps left: the pool's median speed
    only_done = {"done": models["done"], "new": ThroughputModel()}
    assert with_pool_prior(only_done, None, None, {"done": 0.0, "new": 5.0})["new"].steps_per_s(1) == 10.0


def test_guesses_of_two_trainings_never_measured_that_land_on_one_time_rank_by_submit_time():
    """Two never-measured trainings guessed at the same remaining time (the lower quartile, 400 s)
    are ranked by submit time: their times are worked out through different speeds (steps over
    400 s, then steps over that speed), which can differ in the last bit of a float, and must not
    decide the order."""
    from airflow_elastic_gpu.scheduling.state import ClusterState, JobState
    from airflow_elastic_gpu.scheduling.throughput import with_pool_prior

    measured = {f"m{i}": ThroughputModel().with_sample(1, 10.0) for i in range(4)}
    remaining = {"m0": 1000.0, "m1": 4000.0, "m2": 9000.0, "m3": 16000.0,
                 "early": 1_000_005.0, "late": 1_000_004.0}  # each lands on 400 s, up to rounding
    out = with_pool_prior({**measured, "early": ThroughputModel(), "late": ThroughputModel()},
                          {"early": "ncf", "late": "recsys"}, None, remaining)
    assert remaining["early"] / out["early"].steps_per_s(1) == pytest.approx(400.0)
    assert remaining["late"] / out["late"].steps_per_s(1) == pytest.approx(400.0)
    submitted = {"early": 1.0, "late": 5.0}
    jobs = tuple(JobState(k, 1, 1, int(remaining[k]), submit_time_s=submitted.get(k, 0.0), throughput=out[k])
                 for k in ("late", "early"))
    order = AdaptivePolicy().rank(ClusterState((NodeState("n0", (0,)),), jobs, 10.0))
    assert [j.job_id for j in order] == ["early", "late"]


def test_a_short_job_of_a_training_never_measured_is_not_ranked_behind_every_measured_job():
    """The scheduling core gives the guess in time: a waiting job of a fast, never-measured training
    (many cheap steps) is ranked among the measured jobs by time, not last by its step count, so
    the GPU that frees goes to it before a long measured job's."""
    nodes = (NodeState("n0", (0,)),)
    long_run = JobBook("long", 1, 1, 100_000, 0.0, throughput=ThroughputModel().with_sample(1, 1.0))
    waiting_long = JobBook("waiting-long", 1, 1, 50_000, 1.0, throughput=ThroughputModel().with_sample(1, 1.0))
    short = [JobBook(f"s{i}", 1, 1, 100 * (i + 1), 2.0, throughput=ThroughputModel().with_sample(1, 1.0))
             for i in range(3)]
    ncf = JobBook("ncf", 1, 1, 5_000_000, 3.0)  # a million cheap steps: a few minutes
    state = SchedulingCore(AdaptivePolicy(), 10.0).cluster_state(nodes, [long_run, waiting_long, *short, ncf], 10.0)
    order = [j.job_id for j in AdaptivePolicy().rank(state)]
    assert order.index("ncf") < order.index("waiting-long") < order.index("long")


def test_a_job_takes_the_scaling_its_family_measured_beyond_its_own_samples():
    """A scheduled retraining's last run measured on 1, 4 and 8 GPUs (slower on 8: two nodes): its
    next run knows that before it runs there, scaled to its family's single-GPU speed, or through
    its own sample; its own sample stays as it is, and a job measured on two counts keeps its own
    model."""
    from airflow_elastic_gpu.scheduling.throughput import with_pool_prior

    last_run = ThroughputModel(((1, 10.0), (4, 36.0), (8, 30.0)))
    fresh = ThroughputModel()
    out = with_pool_prior({"next": fresh}, {"next": "nightly"}, {"nightly": last_run})
    assert out["next"].observed == last_run.observed and out["next"].prior_source == "family"
    assert out["next"].own_observed == () and out["next"].steps_per_s(8) < out["next"].steps_per_s(4)

    running = ThroughputModel().with_sample(1, 20.0)  # unfinished jobs of the family
    on4 = ThroughputModel().with_sample(4, 18.0)  # half as fast as the last run on 4
    own = ThroughputModel(((1, 9.0), (2, 17.0)))
    as_far = ThroughputModel(((4, 30.0), (8, 24.0)))
    models = {"running": running, "next": fresh, "on4": on4, "own": own, "as_far": as_far, "alone": fresh}
    families = dict.fromkeys(models, "nightly") | {"alone": "etl"}
    out = with_pool_prior(models, families, {"nightly": last_run, "etl": ThroughputModel().with_sample(1, 5.0)})
    # the curve of the job measured on the most counts (the last run: three), scaled to the
    # family's median single-GPU speed over its unfinished measured jobs
    t1 = sorted(m.steps_per_s(1) for m in (running, on4, own, as_far))[2]
    assert dict(out["next"].observed) == pytest.approx({1: t1, 4: 3.6 * t1, 8: 3.0 * t1})
    assert out["on4"].observed == ((4, 18.0), (8, 15.0)) and out["on4"].own_observed == on4.observed
    assert dict(out["running"].observed) == pytest.approx({1: 20.0, 4: 72.0, 8: 60.0})
    assert out["own"] is own and out["as_far"] is as_far  # measured on two counts: their own samples only
    assert (out["alone"].observed, out["alone"].prior_source) == (((1, 5.0),), "family")
    assert out["on4"].scaled(2.0).own_observed == ((4, 36.0),)


def test_on_a_pool_of_several_types_a_job_takes_its_family_s_samples_type_by_type():
    """The last run measured on 1 and 4 V100s and on 4 and 8 K80s: the next run gets both curves
    (each on its own type, scaled through its own sample there); a type nobody of the family ran
    on stays absent, and a job measured on two counts of a type keeps its own model there."""
    from airflow_elastic_gpu.scheduling.throughput import with_family_by_type

    last = {"V100": ThroughputModel(((1, 10.0), (4, 38.0))), "K80": ThroughputModel(((4, 12.0), (8, 20.0)))}
    own_k80 = ThroughputModel(((1, 3.0), (2, 5.5)))
    by_type = {"next": {}, "on_v100": {"V100": ThroughputModel().with_sample(1, 5.0)}, "k80s": {"K80": own_k80},
               "other": {}}
    families = {"next": "f", "on_v100": "f", "k80s": "f", "other": "g"}
    out = with_family_by_type(by_type, families, {"f": last})
    # on K80: the last run's curve (two counts, up to 8), scaled to the family's single-K80 speed (3.0)
    factor = 3.0 / last["K80"].steps_per_s(1)
    assert dict(out["next"]["K80"].observed) == pytest.approx({4: 12.0 * factor, 8: 20.0 * factor})
    assert dict(out["next"]["V100"].observed) == pytest.approx({1: 5.0, 4: 19.0})  # V100: the unfinished job's speed
    assert dict(out["on_v100"]["V100"].observed) == pytest.approx({1: 5.0, 4: 19.0})  # through its own sample
    assert out["on_v100"]["V100"].own_observed == ((1, 5.0),)
    assert out["k80s"]["K80"] is own_k80 and "V100" in out["k80s"]
    assert out["other"] == {} and by_type["next"] == {}  # nothing known; the input is not modified


@given(
    samples=st.dictionaries(st.integers(1, 40), st.floats(0.01, 1000.0), max_size=5),
    alpha=st.floats(0.0, 0.99),
    prior=st.floats(0.01, 1000.0),
    low=st.integers(1, 48),
    width=st.integers(0, 48),
    node_gpus=st.sampled_from([0, 1, 4, 8]),
)
def test_the_best_speed_over_a_range_of_counts_is_the_fastest_count_in_it(samples, alpha, prior, low, width,
                                                                          node_gpus):
    """``best_steps_per_s`` looks at the measured counts and one predicted count per piece of the
    model only; it must equal the brute-force maximum over every count of the range, whatever was
    measured (flat, super-linear, non-monotone samples, on one node or several)."""
    m = ThroughputModel(tuple(sorted(samples.items())), prior_alpha=alpha, prior_steps_per_s=prior,
                        node_gpus=node_gpus)
    high = low + width
    assert m.best_steps_per_s(low, high) == max(m.steps_per_s(n) for n in range(low, high + 1))


def test_the_best_speed_needs_a_range():
    for low, high in ((0, 4), (3, 2)):
        with pytest.raises(ValueError, match="need 1 <= low <= high"):
            ThroughputModel().best_steps_per_s(low, high)


def test_the_scheduling_core_tells_every_model_its_pool_s_node_size_per_gpu_type():
    nodes = (NodeState("v0", tuple(range(8)), "V100"), NodeState("k0", tuple(range(4)), "K80"))
    measured = ThroughputModel(((1, 10.0), (2, 20.0)))
    book = JobBook("j", 1, 8, 1000, 0.0, throughput=measured,
                   throughput_by_type={"V100": measured, "K80": measured.scaled(0.25)})
    state = SchedulingCore(AdaptivePolicy(), 10.0).cluster_state(nodes, [book], 0.0)
    (job,) = state.jobs
    assert job.throughput.node_gpus == 8
    assert {t: m.node_gpus for t, m in job.throughput_by_type.items()} == {"V100": 8, "K80": 4}
    assert book.throughput.node_gpus == 8  # kept on the book: the next decision reuses its predictions


def test_a_family_model_made_for_a_type_a_job_has_none_of_knows_that_type_s_node_size():
    """A job never run on K80 takes its family's K80 curve: the model made for it predicts on the
    K80 nodes' size (4), given by the caller, and one extended from the job's own V100 sample keeps
    the V100 node size its own model had; without node sizes the new model knows none (0)."""
    from airflow_elastic_gpu.scheduling.throughput import with_family_by_type

    last = {"V100": ThroughputModel(((1, 10.0), (8, 60.0))), "K80": ThroughputModel(((1, 3.0), (4, 10.0)))}
    own = {"next": {"V100": ThroughputModel(((1, 9.0),), node_gpus=8)}}
    out = with_family_by_type(own, {"next": "f"}, {"f": last}, {"V100": 8, "K80": 4})
    assert {t: m.node_gpus for t, m in out["next"].items()} == {"V100": 8, "K80": 4}
    assert with_family_by_type(own, {"next": "f"}, {"f": last})["next"]["K80"].node_gpus == 0
    # through the scheduling core: the pool's node sizes, per type
    nodes = (NodeState("v0", tuple(range(8)), "V100"), NodeState("k0", tuple(range(4)), "K80"))
    book = JobBook("next", 1, 8, 1000, 0.0, family="f")
    state = SchedulingCore(AdaptivePolicy(), 10.0).cluster_state(nodes, [book], 0.0, history_by_type={"f": last})
    assert {t: m.node_gpus for t, m in state.jobs[0].throughput_by_type.items()} == {"V100": 8, "K80": 4}


def test_a_scaled_model_is_reused_for_the_same_factor_and_predicts_as_a_fresh_one():
    """A waiting job's model on another GPU type is asked for on every decision: the same factor
    gives the same model (its predictions kept), equal to one built afresh; the models kept per
    base model are bounded (factors that drift, like the pool's speed ratios, do not pile up)."""
    base = ThroughputModel(((1, 10.0), (2, 18.0), (8, 40.0)), node_gpus=4)
    first = base.scaled(0.5)
    assert base.scaled(0.5) is first and base.scaled(1.0) is base
    fresh = ThroughputModel(((1, 5.0), (2, 9.0), (8, 20.0)), prior_steps_per_s=0.5, node_gpus=4)
    assert first == fresh
    assert [first.steps_per_s(n) for n in range(1, 17)] == pytest.approx([fresh.steps_per_s(n) for n in range(1, 17)])
    for k in range(100):
        base.scaled(1.0 + k / 1000)
    assert len(base.__dict__["_scaled"]) <= 8
    assert base == ThroughputModel(((1, 10.0), (2, 18.0), (8, 40.0)), node_gpus=4)  # the cache is not its value
