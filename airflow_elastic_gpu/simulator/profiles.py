"""Measured GPU scaling profiles: samples/s of a model vs GPU count and node spread.

A profile answers "how fast does this model train on ``n`` GPUs spread over
``k`` nodes". Measured points are used as they are; between them the speed is
interpolated linearly in ``n``; a single node larger than any measured one is
extrapolated with the Amdahl fit of the single-node points
(:class:`~airflow_elastic_gpu.scheduling.throughput.ThroughputModel`). Jobs
spread over several nodes use the multi-node measurements (Pollux T4 has them;
sources without them are treated as if every placement were consolidated).
"""

from __future__ import annotations

import bisect
import csv
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from airflow_elastic_gpu.scheduling.state import GpuId
from airflow_elastic_gpu.scheduling.throughput import ThroughputModel

DEFAULT_SOURCE = "pollux"
PROFILE_COLUMNS = ("source", "gpu_type", "model", "num_gpus", "num_nodes", "per_gpu_batch", "global_batch",
                   "samples_per_s", "scaling")
"""The columns :func:`load_profiles` reads (a ``throughput_profiles.csv`` has more)."""

# The workload generator's mapping from a job's GPU-time to a Pollux model
# (as the Pollux artifact's workload generator does it): (upper bound in GPU-hours, models).
POLLUX_MODELS_BY_GPU_HOURS: tuple[tuple[float, tuple[str, ...]], ...] = (
    (1.0, ("cifar10", "ncf")),
    (10.0, ("deepspeech2", "bert")),
    (40.0, ("yolov3",)),
    (float("inf"), ("imagenet",)),
)


class ProfileError(ValueError):
    """A profile file or a model name is unusable; the message says which."""


def bundled_data(name: str) -> Path:
    """Path of a CSV shipped in ``airflow_elastic_gpu/simulator/data/`` (traces and profiles)."""
    return Path(str(resources.files("airflow_elastic_gpu.simulator") / "data" / name))


def _interpolate(points: list[tuple[int, float]], n: int) -> float:
    """Linear in ``n`` between sorted ``points``; ``(0, 0)`` below the first, flat above the last."""
    counts = [p[0] for p in points]
    i = bisect.bisect_left(counts, n)
    if i < len(points) and counts[i] == n:
        return points[i][1]
    if i == len(points):
        return points[-1][1]
    lo = points[i - 1] if i > 0 else (0, 0.0)
    hi = points[i]
    return lo[1] + (hi[1] - lo[1]) * (n - lo[0]) / (hi[0] - lo[0])


@dataclass(frozen=True)
class Profile:
    """Throughput of one model (samples/s) measured on one GPU type.

    :param model: model name, e.g. ``"bert"``.
    :param single_node: ``(num_gpus, samples_per_s)`` with all GPUs on one node, sorted.
    :param multi_node: ``(num_gpus, samples_per_s)`` measured across nodes, sorted (may be empty).
    """

    model: str
    source: str
    gpu_type: str
    single_node: tuple[tuple[int, float], ...]
    multi_node: tuple[tuple[int, float], ...] = ()
    _cache: dict[tuple[int, int], float] = field(default_factory=dict, compare=False, repr=False)

    @property
    def max_gpus(self) -> int:
        """The largest GPU count measured."""
        return max(n for n, _ in (*self.single_node, *self.multi_node))

    def samples_per_s(self, num_gpus: int, num_nodes: int = 1) -> float:
        """Training speed on ``num_gpus`` (>= 1) GPUs spread over ``num_nodes`` (>= 1) nodes."""
        key = (num_gpus, num_nodes)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if num_gpus < 1 or num_nodes < 1:
            raise ValueError(f"need num_gpus >= 1 and num_nodes >= 1, got {num_gpus}, {num_nodes}")
        single = list(self.single_node)
        if num_nodes > 1 and self.multi_node:
            value = _interpolate(list(self.multi_node), num_gpus)
        elif num_gpus <= single[-1][0] or num_nodes > 1:
            value = _interpolate(single or list(self.multi_node), num_gpus)
        else:  # one node bigger than any measured: Amdahl fit of the single-node points
            value = ThroughputModel(tuple(single)).steps_per_s(num_gpus)
        self._cache[key] = value
        return value

    def speed_on(self, gpus: Sequence[GpuId]) -> float:
        """Training speed on these GPUs (>= 1): their count and the number of nodes they span."""
        return self.samples_per_s(len(gpus), len({g.node for g in gpus}))


@dataclass(frozen=True)
class ProfileSet:
    """All profiles of one source and GPU type, by model name."""

    source: str
    gpu_type: str
    profiles: dict[str, Profile]

    def __getitem__(self, model: str) -> Profile:
        try:
            return self.profiles[model]
        except KeyError:
            raise ProfileError(
                f"no {self.source}/{self.gpu_type} throughput profile for model {model!r}; "
                f"known: {', '.join(sorted(self.profiles))}"
            ) from None

    def assign(self, model: str | None, gpu_time_s: float, rng: random.Random) -> Profile:
        """The profile for a trace job: its ``model`` if given, else drawn (seeded) by its GPU-time."""
        if model:
            return self[model]
        if self.source == "pollux":
            hours = gpu_time_s / 3600.0
            for bound, names in POLLUX_MODELS_BY_GPU_HOURS:
                if hours < bound:
                    return self[rng.choice(names)]
        return self.profiles[rng.choice(sorted(self.profiles))]


def load_profiles(
    path: str | Path | None = None, source: str = DEFAULT_SOURCE, gpu_type: str | None = None
) -> ProfileSet:
    """Load the profiles of ``source`` (and ``gpu_type``, default: the source's first) from a CSV.

    Rows of a model with several batch settings keep the setting with the
    most GPU counts (ties: the first in the file).

    :param path: a ``throughput_profiles.csv``; default the bundled one.
    :raises ProfileError: missing file, a column missing, unknown source or GPU type (the message
        lists the known ones), a GPU count that is not an integer >= 1 or a speed that is not a
        finite number > 0 (the message names the file and line).
    """
    path = Path(path) if path is not None else bundled_data("throughput_profiles.csv")
    if not path.is_file():
        raise ProfileError(f"throughput profile file {str(path)!r} does not exist")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    if missing := [c for c in PROFILE_COLUMNS if c not in (reader.fieldnames or ())]:
        raise ProfileError(f"{path}: not a throughput profile file: no column {', '.join(missing)} "
                           f"(it needs {', '.join(PROFILE_COLUMNS)})")

    def pair(r: dict[str, str]) -> tuple[int, float]:  # (num_gpus, samples_per_s) of a row, checked
        try:
            n, speed = int(r["num_gpus"]), float(r["samples_per_s"])
        except (TypeError, ValueError):
            n, speed = 0, 0.0
        if n < 1 or not (math.isfinite(speed) and speed > 0):
            raise ProfileError(f"{path}, line {next(i for i, x in enumerate(rows) if x is r) + 2}: num_gpus must be an integer >= 1 and "
                               f"samples_per_s a finite number > 0, got {r['num_gpus']!r} and {r['samples_per_s']!r}")
        return n, speed
    kinds = sorted({(r["source"], r["gpu_type"]) for r in rows})
    sources = sorted({s for s, _ in kinds})
    if source not in sources:
        raise ProfileError(f"unknown profile source {source!r}; known: {', '.join(sources)}")
    types = [t for s, t in kinds if s == source]
    gpu_type = gpu_type or types[0]
    if gpu_type not in types:
        raise ProfileError(f"source {source!r} has no GPU type {gpu_type!r}; known: {', '.join(types)}")
    # group by (model, batch setting)
    groups: dict[tuple[str, str], list[dict[str, str]]] = {}
    for r in rows:
        if r["source"] == source and r["gpu_type"] == gpu_type:
            setting = r["per_gpu_batch"] if r["scaling"] == "weak" else r["global_batch"]
            if source == "pollux":
                setting = "fixed"  # the summary already holds one per-GPU batch per model
            groups.setdefault((r["model"], setting), []).append(r)
    profiles: dict[str, Profile] = {}
    for (model, _), group in groups.items():
        if model in profiles and len(group) <= len(profiles[model].single_node) + len(profiles[model].multi_node):
            continue
        single = sorted(pair(r) for r in group if (r["num_nodes"] or "1") == "1")
        multi = sorted(pair(r) for r in group if (r["num_nodes"] or "1") != "1")
        if single:
            profiles[model] = Profile(model, source, gpu_type, tuple(single), tuple(multi))
    return ProfileSet(source, gpu_type, profiles)
