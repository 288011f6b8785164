"""Per-job throughput model: steps/s as a function of GPU count, fitted from progress samples.

The model is Amdahl's law written as a line in ``1/n``::

    1 / throughput(n) = a / n + b        (a: parallel part, b: serial part; s/step)

which is ``throughput(n) = t1 * n / (1 + alpha * (n - 1))`` with ``t1 = 1/(a+b)``
and ``alpha = b/(a+b)``. Optimus (Peng et al., EuroSys'18, section 4.1) fits a
speed function of the same family by least squares; Pollux (Qiao et al.,
OSDI'21) models synchronisation cost the same way. Until a job has run on two
GPU counts, ``alpha`` comes from a prior (near-linear scaling), so a new job is
not starved of GPUs it may well use, unless a job of the same family was measured
on more counts (:func:`with_pool_prior`: a scheduled retraining's next run
scales as its last run did).

Amdahl's law describes the counts where more GPUs help, on one kind of interconnect. A count
measured slower than a smaller one (a job spread over more nodes, say) is another regime: the
counts below the fastest measured one are predicted from the samples up to it, the others from
all samples; and when the model knows the pool's node size (``node_gpus``), the counts of one node
from the samples on one node (both may apply: three pieces). A flat fit (more GPUs never helped)
is linear up to its fastest measured count and level beyond.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

DEFAULT_PRIOR_ALPHA = 0.05
DEFAULT_PRIOR_STEPS_PER_S = 1.0
EMA_WEIGHT = 0.3
SPEED_RANGE = (1e-9, 1e9)
"""The throughput samples a model takes (steps/s): a step per 30 years to a billion steps a second.
A trainer's absurd report (a step of 1e308 half a second after step 0: an infinite speed; a step of
5e-324: a denormal one) made the fits divide by zero, and every rebalance of the pool failed."""


def plausible_speed(steps_per_s: float) -> bool:
    """Whether ``steps_per_s`` is a finite throughput within :data:`SPEED_RANGE`."""
    return math.isfinite(steps_per_s) and SPEED_RANGE[0] <= steps_per_s <= SPEED_RANGE[1]


@dataclass(frozen=True)
class ThroughputModel:
    """Throughput of one job vs GPU count.

    :param observed: ``(num_gpus, steps_per_s)`` pairs, one per GPU count the
        job has run on (each a moving average of its samples), sorted by count.
    :param prior_alpha: serial fraction assumed before two counts are seen,
        in ``[0, 1)``; 0 means linear scaling.
    :param prior_steps_per_s: single-GPU throughput assumed before any sample.
    :param prior_source: where ``prior_steps_per_s`` comes from: ``"family"`` (measured jobs of the
        same training: :func:`with_pool_prior`), ``"pool"`` (a guess from the pool's measured
        jobs: :func:`with_pool_prior`), or ``""`` (the default). Not part of the model's value
        (equality ignores it).
    :param own_max_gpus: where ``observed`` ends with samples of the job's family (a prior,
        :func:`with_pool_prior`): the largest GPU count of the job's own samples (0: none); the
        samples above it are the family's. None: every sample is the job's own.
    :param node_gpus: GPUs of one node of the job's pool (0: not known). With samples on both
        sides of it, the counts up to it (one node) are fitted to the samples up to it, the others
        to all samples: synchronisation within a node and across nodes cost differently (Pollux,
        Qiao et al., OSDI'21, section 3.2, fits them as separate terms), and a sample over two
        nodes bent the single-node fit (4 GPUs predicted at 33 steps/s where 1 and 2 measured
        linear and 4 ran 52).
    """

    observed: tuple[tuple[int, float], ...] = ()
    prior_alpha: float = DEFAULT_PRIOR_ALPHA
    prior_steps_per_s: float = DEFAULT_PRIOR_STEPS_PER_S
    prior_source: str = field(default="", compare=False)
    own_max_gpus: int | None = field(default=None, compare=False)
    node_gpus: int = 0

    @property
    def own_observed(self) -> tuple[tuple[int, float], ...]:
        """The samples measured on the job itself (``observed`` less its family's)."""
        if self.own_max_gpus is None:
            return self.observed
        return tuple(s for s in self.observed if s[0] <= self.own_max_gpus)

    @property
    def from_own_training(self) -> bool:
        """True if the model rests on measurements of this training: its own samples, or a prior
        from measured jobs of the same family (not the pool-wide guess)."""
        return bool(self.observed) or self.prior_source == "family"

    def __post_init__(self) -> None:
        if not 0.0 <= self.prior_alpha < 1.0:
            raise ValueError(f"prior_alpha must be in [0, 1), got {self.prior_alpha}")
        if self.prior_steps_per_s <= 0:
            raise ValueError(f"prior_steps_per_s must be > 0, got {self.prior_steps_per_s}")
        if isinstance(self.node_gpus, bool) or not isinstance(self.node_gpus, int) or self.node_gpus < 0:
            raise ValueError(f"node_gpus must be an integer >= 0, got {self.node_gpus!r}")
        for n, t in self.observed:  # a model made from others (a family's, another type's) may lie
            if n < 1 or not (math.isfinite(t) and t > 0):  # out of SPEED_RANGE: its samples are scaled
                raise ValueError(f"bad throughput sample: {t} steps/s on {n} GPUs")

    def with_sample(self, num_gpus: int, steps_per_s: float) -> ThroughputModel:
        """Return a model that has also seen ``steps_per_s`` (:func:`plausible_speed`) measured on
        ``num_gpus`` (>= 1).

        :raises ValueError: a GPU count < 1 or a speed out of :data:`SPEED_RANGE`."""
        if num_gpus < 1 or not plausible_speed(steps_per_s):
            raise ValueError(f"bad throughput sample: {steps_per_s} steps/s on {num_gpus} GPUs")
        merged = dict(self.observed)
        old = merged.get(num_gpus)
        merged[num_gpus] = (
            steps_per_s if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * steps_per_s
        )
        return ThroughputModel(
            tuple(sorted(merged.items())), self.prior_alpha, self.prior_steps_per_s, node_gpus=self.node_gpus
        )

    def on_nodes_of(self, node_gpus: int) -> ThroughputModel:
        """This model on a pool whose nodes have ``node_gpus`` GPUs (itself if it knows already)."""
        if node_gpus == self.node_gpus:
            return self
        return replace(self, node_gpus=node_gpus)

    def scaled(self, factor: float) -> ThroughputModel:
        """The same model with every throughput (measured and prior) multiplied by ``factor`` (> 0):
        the job on another GPU type that runs it ``factor`` times as fast at every count.

        :raises ValueError: ``factor <= 0``.
        """
        if not factor > 0:
            raise ValueError(f"factor must be > 0, got {factor!r}")
        if factor == 1.0:
            return self
        # kept on this model for the next call with the same factor (a waiting job's model on
        # another GPU type, asked again on every decision): its predictions are then reused
        cache = self.__dict__.get("_scaled")
        if cache is None:
            cache = self.__dict__["_scaled"] = {}
        model = cache.get(factor)
        if model is None:
            model = object.__new__(ThroughputModel)  # valid by construction: skip the checks (hot path)
            model.__dict__.update(observed=tuple([(n, t * factor) for n, t in self.observed]),
                                  prior_alpha=self.prior_alpha, prior_steps_per_s=self.prior_steps_per_s * factor,
                                  prior_source=self.prior_source, own_max_gpus=self.own_max_gpus,
                                  node_gpus=self.node_gpus)
            if len(cache) >= 8:  # factors that drift (pool ratios): keep the latest few
                cache.clear()
            cache[factor] = model
        return model

    @cached_property
    def steps_per_s(self) -> Callable[[int], float]:
        """Predicted steps/s on ``num_gpus`` (>= 1) GPUs, as ``model.steps_per_s(num_gpus)``;
        a measured count returns its measurement.

        :raises ValueError: ``num_gpus < 1``.

        A look-up in a memo dict that predicts each count on its first look-up, so
        a call is a C-level dict look-up: policies make tens of thousands per decision.
        """
        return _Predictions(self.observed, self.prior_alpha, self.prior_steps_per_s, self.node_gpus).__getitem__

    def speedup(self, num_gpus: int) -> float:
        """``steps_per_s(num_gpus) / steps_per_s(1)``."""
        return self.steps_per_s(num_gpus) / self.steps_per_s(1)

    def best_steps_per_s(self, low: int, high: int) -> float:
        """The most steps/s :attr:`steps_per_s` gives at any count from ``low`` to ``high`` GPUs.

        Predicted counts never get slower as the count grows within each of the model's pieces (up
        to ``node_gpus``, below its fastest measured count, and the rest: ``1/t = a/n + b`` with
        ``a, b >= 0``, or a flat fit: linear up to its fastest measured count, level beyond), so
        the candidates are the measured counts in the range and, in each piece, its largest count
        in the range not measured: the cost grows with the measured counts, not with
        ``high - low`` (a policy asks this of every waiting job of a large pool, whose
        ``max_gpus`` may be in the hundreds).

        :raises ValueError: ``low < 1`` or ``high < low``.
        """
        if low < 1 or high < low:
            raise ValueError(f"need 1 <= low <= high, got low={low!r}, high={high!r}")
        speed, observed = self.steps_per_s, self.observed
        fastest = max(observed, key=lambda s: s[1])[0] if observed else 0
        best = 0.0
        tops = [high]  # the largest count in the range not measured, in each piece
        if low < fastest <= high:
            tops.append(fastest - 1)
        if low <= self.node_gpus < high:
            tops.append(self.node_gpus)
        measured = {n for n, _ in observed}
        for n, t in observed:
            if low <= n <= high:
                best = max(best, t)
        for top in tops:
            while top >= low and top in measured:
                top -= 1
            if top >= low:
                best = max(best, speed(top))
        return best


class _Predictions(dict):
    """One model's steps/s by GPU count: its measurements, and each other count predicted on its first look-up.

    Holds the model's values, not the model, so that no reference cycle keeps a model alive.
    """

    __slots__ = ("_below", "_fit_args", "_knee", "_line")

    def __init__(
        self, observed: tuple[tuple[int, float], ...], prior_alpha: float, prior_steps_per_s: float,
        node_gpus: int = 0,
    ) -> None:
        super().__init__(observed)
        self._fit_args = (observed, prior_alpha, prior_steps_per_s, node_gpus)
        self._line: tuple[float, float] | None = None
        self._knee: tuple[int, float] = (0, 0.0)  # a flat fit's fastest measured (count, steps/s)
        # the lower pieces, ascending: (first count above the piece, the line fitted to the samples
        # in it): one node's counts, when samples lie on both sides of the node size below the
        # piece above; the counts below the fastest measured one, when a count above it was measured
        # slower; empty when neither (or the fit is flat)
        self._below: tuple[tuple[int, tuple[float, float]], ...] = ()

    def __missing__(self, num_gpus: int) -> float:
        if num_gpus < 1:
            raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
        if self._line is None:  # fitted once, on the first count that was not measured
            observed, prior_alpha, prior_steps_per_s, node = self._fit_args
            self._line = _fit_line(observed, prior_alpha, prior_steps_per_s)
            if observed:
                fastest = max(observed, key=lambda s: s[1])
                if self._line[0] == 0.0:  # flat: more GPUs never helped
                    self._knee = fastest
                else:
                    pieces = []
                    top = observed[-1][0]
                    if fastest[0] < top:  # measured slower above its fastest count
                        top = fastest[0]
                        pieces.append((top, _fit_line(tuple(s for s in observed if s[0] <= top),
                                                      prior_alpha, prior_steps_per_s)))
                    if observed[0][0] <= node < top:  # samples within one node and across nodes
                        pieces.insert(0, (node + 1, _fit_line(tuple(s for s in observed if s[0] <= node),
                                                              prior_alpha, prior_steps_per_s)))
                    self._below = tuple(pieces)
        a, b = self._line
        knee_n, knee_t = self._knee
        if num_gpus < knee_n:  # fewer GPUs than a flat fit's fastest measured count: linear below it
            value = self[num_gpus] = knee_t * num_gpus / knee_n
        else:
            for limit, line in self._below:  # a lower piece: its own fit
                if num_gpus < limit:
                    a, b = line
                    break
            value = self[num_gpus] = 1.0 / (a / num_gpus + b)
        return value


def _fit_line(
    observed: tuple[tuple[int, float], ...], prior_alpha: float, prior_steps_per_s: float
) -> tuple[float, float]:
    """``(a, b)`` of ``1/throughput(n) = a/n + b`` (s/step), both >= 0, ``a + b > 0``.

    Least squares over the samples in ``1/n``; with fewer than two GPU counts
    seen, the slope comes from ``prior_alpha``.
    """
    if not observed:
        inv_t1 = 1.0 / prior_steps_per_s
        return (1 - prior_alpha) * inv_t1, prior_alpha * inv_t1
    if len(observed) == 1:
        (n0, t0), alpha = observed[0], prior_alpha
        # t0 = t1 * n0 / (1 + alpha (n0 - 1))  =>  1/t1 = n0 / (t0 (1 + alpha (n0 - 1)))
        inv_t1 = n0 / (t0 * (1 + alpha * (n0 - 1)))
        return (1 - alpha) * inv_t1, alpha * inv_t1
    xs = [1.0 / n for n, _ in observed]
    ys = [1.0 / t for _, t in observed]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    b = my - a * mx
    if a <= 0:  # more GPUs never helped: flat throughput at the best seen (linear below its
        return 0.0, min(ys)  # count: _Predictions)
    if b < 0:  # super-linear samples: clamp to linear through the mean
        return my / mx, 0.0
    return a, b


RESTART_OVERHEAD_EMA = 0.5
"""Weight of a new measurement in a job's moving average of restart overhead."""


def with_pool_prior(
    models: dict[str, ThroughputModel],
    families: Mapping[str, str | None] | None = None,
    history: Mapping[str, ThroughputModel] | None = None,
    remaining_steps: Mapping[str, float] | None = None,
) -> dict[str, ThroughputModel]:
    """Give every job what its family measured beyond its own samples, else a guess from the pool
    as a prior.

    A job's **family** is the training it repeats (the broker: the job's family, ``dag_id.task_id``
    of a scheduled retraining's operator; the simulator: the trace job's model). Its measured jobs
    are the unfinished ones of the pool and ``history`` (the family's last finished job).

    * A job not yet measured is assumed as fast on one GPU as its family's median measured
      unfinished job (else its last finished one). The prior matters most for waiting jobs: the
      policy ranks them by predicted remaining time (steps / throughput) before they have run.
    * A job of a training never measured (no family, or none of it measured) is a guess: as fast
      on one GPU as the pool's median measured job. Steps of different trainings differ by orders
      of magnitude (an NCF step is not a BERT step), so with ``remaining_steps`` the guess is also
      made in time: the job is assumed to have at most as much single-GPU time left as the pool's
      measured job at the lower quartile of remaining single-GPU time (its prior speed is then its
      remaining steps over that time; the jobs of one such family share one speed, that of their
      median remaining steps, so they keep their order by steps). Of the two remaining times the
      shorter counts: least attained service (Tiresias, Gu et al., NSDI'19) serves the jobs that
      have had no service first when sizes are unknown, and the unfinished jobs of a pool
      over-represent long ones (they stay longer). The pool's median speed alone ranked a 5-minute
      NCF job (millions of cheap steps) behind every measured job of a busy pool, where it waited
      hours (``docs/benchmarks.md``, section 2). Without ``remaining_steps`` (or no measured job
      with steps left), the guess is the pool's median measured single-GPU speed.
    * A job measured on fewer than two GPU counts also takes the samples of its family's job
      measured on the most counts (ties: up to the largest count) at the counts above its own,
      scaled through its own sample (the family job's throughput at that count, measured or
      fitted), or to the family's median single-GPU throughput when it has none: how the training
      scales, and whether spreading it over more nodes helped, are then known before the job runs
      there (the adaptive policy spreads a job over more nodes than its request only once it, or
      so its family, was measured on a whole node: :func:`~airflow_elastic_gpu.scheduling.grant.grant`).
      Its own sample is kept as it is (family samples only above it); from its second count on,
      its own samples alone (extending those too read 0.503 / 0.621 on the benchmarks' 16-GPU
      workloads against 0.500 / 0.614).

    With no measured job and no history, the models are returned unchanged. On a pool of several
    GPU types this is the model of a job not yet measured on any type; once measured on a type, its
    per-type samples (``JobState.throughput_by_type``) are used without its family's.

    :param models: job id -> model; not modified.
    :param families: job id -> family (``None``: none); default no families.
    :param history: family -> the model (its samples) of its last finished job.
    :param remaining_steps: job id -> steps the job has left (>= 0), for every job of ``models``:
        the guess for a training never measured is made in time (above).
    :returns: job id -> model (jobs measured on two counts or more, and jobs whose family knows
        nothing beyond their own sample, keep the same objects); a prior's ``prior_source`` says
        where it came from, and its ``own_max_gpus`` which samples are the family's.
    """
    families = families or {}
    history = history or {}
    known_t1 = sorted(m.steps_per_s(1) for m in models.values() if m.observed)
    if not known_t1 and not history:
        return dict(models)
    pool = known_t1[len(known_t1) // 2] if known_t1 else None
    # the guess in time: the lower quartile of the measured jobs' remaining single-GPU time (s)
    left_s = sorted(remaining_steps[k] / m.steps_per_s(1) for k, m in models.items()
                    if m.observed and remaining_steps.get(k, 0.0) > 0) if remaining_steps is not None else []
    guess_s = left_s[len(left_s) // 4] if left_s else None
    family_t1, family_curve = _family_samples(models, families, history)

    def prior(job_id: str, m: ThroughputModel) -> ThroughputModel | None:
        """The job's model with its family's samples or prior; None: a guess (made below)."""
        family = families.get(job_id)
        if family is not None and family in family_curve:
            extended = _with_family(m, family_curve[family], family_t1[family])
            if extended is not None:
                return extended
        if m.observed:
            return m
        t1 = family_t1.get(family) if family is not None else None
        if t1 is not None and t1 > 0:
            return ThroughputModel(prior_alpha=m.prior_alpha, prior_steps_per_s=t1, prior_source="family")
        return None

    out = {k: prior(k, m) for k, m in models.items()}
    # the guesses: one speed per family (steps of one training compare, so its jobs keep their order
    # by steps, ties by submit time), its guessed jobs' median remaining steps taking guess_s, or the
    # pool's median speed where that is faster (the shorter of the two remaining times)
    guessed: dict[str | None, list[str]] = {}
    for k, p in out.items():
        if p is None:
            guessed.setdefault(families.get(k), []).append(k)
    for ids in guessed.values():
        if guess_s is not None:
            steps = sorted(max(remaining_steps.get(k, 0.0), 1.0) for k in ids)
            guess = steps[len(steps) // 2] / guess_s
            guess = max(guess, pool) if pool is not None else guess
        elif pool is not None:
            guess = pool
        else:
            out.update((k, models[k]) for k in ids)
            continue
        for k in ids:
            out[k] = ThroughputModel(prior_alpha=models[k].prior_alpha, prior_steps_per_s=guess, prior_source="pool")
    return out


def with_family_by_type(
    by_type: Mapping[str, Mapping[str, ThroughputModel]],
    families: Mapping[str, str | None],
    history_by_type: Mapping[str, Mapping[str, ThroughputModel]] | None = None,
    node_gpus: Mapping[str, int] | None = None,
    other_node_gpus: int = 0,
) -> dict[str, dict[str, ThroughputModel]]:
    """:func:`with_pool_prior`'s family samples on a pool of several GPU types, type by type: a job
    measured on fewer than two counts of a type (or not at all) takes the samples its family's
    job measured on the most counts of that type, above its own, scaled through its own sample
    there (else to the family's median single-GPU throughput on the type). No pool guess
    here: a job no family job ran on a type has no model of that type (the policy scales its
    model from another type by relative speed).

    :param by_type: job id -> GPU type -> the job's own model on that type; not modified.
    :param families: job id -> family (``None``: none).
    :param history_by_type: family -> GPU type -> its last finished job's model on that type.
    :param node_gpus: GPU type -> GPUs of its largest node: the node size
        (:attr:`ThroughputModel.node_gpus`) of a model made for a type the job has no model of (a
        model extended from the job's own keeps the job's); default 0 (not known).
    :param other_node_gpus: the node size for a type ``node_gpus`` does not name (0: not known).
    :returns: job id -> GPU type -> model (a job's own models where its family adds nothing).
    """
    history_by_type = history_by_type or {}
    node_gpus = node_gpus or {}
    types = sorted({t for d in by_type.values() for t in d} | {t for d in history_by_type.values() for t in d})
    out = {job_id: dict(d) for job_id, d in by_type.items()}
    for t in types:
        unmeasured = ThroughputModel(node_gpus=node_gpus.get(t, other_node_gpus))
        on_t = {job_id: d[t] for job_id, d in by_type.items() if t in d}
        last = {f: d[t] for f, d in history_by_type.items() if t in d}
        family_t1, family_curve = _family_samples(on_t, families, last)
        if not family_curve:
            continue
        for job_id in by_type:
            family = families.get(job_id)
            if family is None or family not in family_curve:
                continue
            extended = _with_family(on_t.get(job_id, unmeasured), family_curve[family], family_t1[family])
            if extended is not None:
                out[job_id][t] = extended
    return out


def _family_samples(
    models: Mapping[str, ThroughputModel], families: Mapping[str, str | None], history: Mapping[str, ThroughputModel],
) -> tuple[dict[str, float], dict[str, ThroughputModel]]:
    """Per family: its median measured single-GPU throughput (its unfinished jobs', else its last
    finished one's), and the model of its job measured on the most counts (ties: up to the
    largest count): ``(family_t1, family_curve)``."""
    by_family: dict[str, list[ThroughputModel]] = {}
    for k, m in models.items():
        family = families.get(k)
        if family is not None and m.observed:
            by_family.setdefault(family, []).append(m)
    family_t1: dict[str, float] = {}
    family_curve: dict[str, ThroughputModel] = {}
    for f in by_family.keys() | history.keys():
        last = history.get(f)
        last = [last] if last is not None and last.observed else []
        unfinished = by_family.get(f, [])
        if not (unfinished or last):
            continue
        t1s = sorted(m.steps_per_s(1) for m in unfinished or last)
        family_t1[f] = t1s[len(t1s) // 2]  # the median
        family_curve[f] = max(unfinished + last, key=lambda m: (len(m.observed), m.observed[-1][0]))
    return family_t1, family_curve


def _with_family(m: ThroughputModel, curve: ThroughputModel, family_t1: float) -> ThroughputModel | None:
    """``m`` with ``curve``'s samples above its own largest count, scaled through its own sample
    there (else to ``family_t1`` on one GPU); None when ``m`` has two counts or more, or ``curve``
    reaches no further."""
    own_max = m.observed[-1][0] if m.observed else 0
    if len(m.observed) >= 2 or curve.observed[-1][0] <= own_max:
        return None
    if m.observed:  # through its own sample at its largest count (the curve on the job's nodes)
        factor = m.observed[-1][1] / curve.on_nodes_of(m.node_gpus).steps_per_s(own_max)
    else:
        factor = family_t1 / curve.steps_per_s(1)
    beyond = tuple((n, t * factor) for n, t in curve.observed if n > own_max)
    return ThroughputModel(m.observed + beyond, m.prior_alpha, m.prior_steps_per_s, "family", own_max, m.node_gpus)


def update_restart_overhead(current_s: float | None, measured_s: float) -> float:
    """Fold one measured restart overhead (seconds, >= 0) into a job's moving average."""
    measured_s = max(0.0, measured_s)
    if current_s is None:
        return measured_s
    return RESTART_OVERHEAD_EMA * measured_s + (1 - RESTART_OVERHEAD_EMA) * current_s
