"""Clusters of several GPU types for the simulator, and each model's measured speed on every type.

A mixed cluster is written ``2x4:V100,2x4:K80`` (groups of ``NODESxGPUS_PER_NODE:TYPE``). Each
type's speeds come from the profile source that measured it (:data:`SOURCE_OF_TYPE`: Gavel's K80,
P100, V100; ElasticFlow's A100; Pollux's T4). A job runs one model; on GPUs of one type it trains at
that type's measured speed, on GPUs of several types every GPU keeps the pace of the slowest one
(synchronous data-parallel training waits for its slowest worker, as Gavel's simulator assumes).

As in Gavel's simulator, a trace job's recorded duration is taken as measured on the *reference*
type, the first type of the cluster spec: its work is ``duration_s x samples/s`` there.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from airflow_elastic_gpu.scheduling.state import GpuId, NodeState
from airflow_elastic_gpu.simulator.profiles import (
    POLLUX_MODELS_BY_GPU_HOURS,
    Profile,
    ProfileError,
    ProfileSet,
    load_profiles,
)

if TYPE_CHECKING:  # the engine imports this module; its classes are imported where they are used
    from airflow_elastic_gpu.simulator.engine import ClusterShape

SOURCE_OF_TYPE = {"K80": "gavel", "P100": "gavel", "V100": "gavel", "A100": "elasticflow", "T4": "pollux"}
"""Which measurements of ``throughput_profiles.csv`` give a GPU type's speeds."""

MODEL_ALIASES = {"elasticflow": {"resnet50": "imagenet", "resnet50_cifar10": "cifar10"}}
"""Source -> its model name -> the name another source uses for the same model (ElasticFlow's
ResNet-50 is Pollux's ``imagenet``, both ResNet-50 on ImageNet; ``cifar10``: a ResNet on CIFAR-10)."""


@dataclass(frozen=True)
class MixedCluster:
    """Groups of identical nodes, each group with its GPU type; nodes are numbered across groups.

    :param groups: one :class:`~airflow_elastic_gpu.simulator.engine.ClusterShape` per group, the
        reference type first.
    :raises SimulationError: no group.
    """

    groups: tuple[ClusterShape, ...]

    def __post_init__(self) -> None:
        from airflow_elastic_gpu.simulator.engine import SimulationError

        if not self.groups:
            raise SimulationError("a mixed cluster needs at least one group of nodes")

    @classmethod
    def parse(cls, text: str) -> MixedCluster:
        """``"2x4:V100,2x4:K80"`` -> 2 nodes of 4 V100 and 2 nodes of 4 K80.

        :raises SimulationError: a group that is not ``NODESxGPUS:TYPE``.
        """
        from airflow_elastic_gpu.simulator.engine import ClusterShape, SimulationError

        groups = []
        for part in (text or "").split(","):
            m = re.fullmatch(r"\s*(\d+\s*[xX]\s*\d+)\s*:\s*([A-Za-z0-9_.-]+)\s*", part)
            if not m:
                raise SimulationError(
                    f"a mixed cluster looks like NODESxGPUS:TYPE,... e.g. 2x4:V100,2x4:K80, got {text!r}")
            groups.append(ClusterShape.parse(m.group(1), m.group(2)))
        return cls(tuple(groups))

    @property
    def capacity(self) -> int:
        return sum(g.capacity for g in self.groups)

    @property
    def nodes(self) -> int:
        return sum(g.nodes for g in self.groups)

    @property
    def gpus_per_node(self) -> int:
        """The largest node's GPU count."""
        return max(g.gpus_per_node for g in self.groups)

    @property
    def gpu_type(self) -> str:
        """The reference type (the first group's)."""
        return self.groups[0].gpu_type

    @property
    def gpu_types(self) -> tuple[str, ...]:
        """The types, in spec order, each once."""
        return tuple(dict.fromkeys(g.gpu_type for g in self.groups))

    def type_sizes(self) -> dict[str, tuple[int, int]]:
        """Type -> ``(its GPUs, its largest node's GPUs)``."""
        sizes: dict[str, tuple[int, int]] = {}
        for g in self.groups:
            gpus, per_node = sizes.get(g.gpu_type, (0, 0))
            sizes[g.gpu_type] = (gpus + g.capacity, max(per_node, g.gpus_per_node))
        return sizes

    def node_states(self) -> tuple[NodeState, ...]:
        width = len(str(self.nodes - 1))
        out, i = [], 0
        for g in self.groups:
            for _ in range(g.nodes):
                out.append(NodeState(f"node-{i:0{width}d}", tuple(range(g.gpus_per_node)), g.gpu_type))
                i += 1
        return tuple(out)

    def __str__(self) -> str:
        return ",".join(f"{g}:{g.gpu_type}" for g in self.groups)


def parse_cluster(text: str, gpu_type: str = "T4") -> ClusterShape | MixedCluster:
    """``4x4`` (one type, ``gpu_type``) or ``2x4:V100,2x4:K80`` (several).

    :raises SimulationError: neither form.
    """
    from airflow_elastic_gpu.simulator.engine import ClusterShape

    return MixedCluster.parse(text) if ":" in (text or "") else ClusterShape.parse(text, gpu_type)


@dataclass(frozen=True)
class TypedProfile:
    """One model's speed on every type of a mixed cluster (samples/s).

    :param profiles: type -> that type's measured profile of the model, the reference type first.
    :param node_types: node name -> its GPU type.
    """

    model: str
    profiles: Mapping[str, Profile]
    node_types: Mapping[str, str]
    _cache: dict[tuple[str, int, int], float] = field(default_factory=dict, compare=False, repr=False)

    @property
    def reference(self) -> Profile:
        return next(iter(self.profiles.values()))

    @property
    def max_gpus(self) -> int:
        """The largest GPU count measured on the reference type."""
        return self.reference.max_gpus

    @property
    def relative_speed(self) -> dict[str, float]:
        """Type -> single-GPU samples/s: the hint a submitter who profiled the model would give."""
        return {t: p.samples_per_s(1) for t, p in self.profiles.items()}

    def samples_per_s(self, num_gpus: int, num_nodes: int = 1) -> float:
        """Speed on the reference type (the trace's durations are taken as measured there)."""
        return self.reference.samples_per_s(num_gpus, num_nodes)

    def speeds_by_count(self, max_gpus: int, sizes: Mapping[str, tuple[int, int]]) -> list[float]:
        """The fastest the model can train at each count ``1..max_gpus`` on a cluster of ``sizes``
        (type -> ``(its GPUs, its largest node's GPUs)``, as :meth:`MixedCluster.type_sizes`):
        the best over every set of types with that many GPUs of the pace of its slowest type
        (:meth:`speed_on`), on as few nodes as the set's largest node allows; an upper bound on any
        placement's speed, so that the ideal run times and the lower bounds drawn from it hold.
        A count on one type is capped by that type's GPUs: a 16-GPU ideal on a type of 8 is not one.
        """
        types = [t for t in self.profiles if sizes.get(t, (0, 0))[0] > 0]
        # every set of types, with its GPUs and its largest node's GPUs
        subsets = []
        for mask in range(1, 1 << len(types)):
            subset = [t for k, t in enumerate(types) if mask >> k & 1]
            subsets.append((subset, sum(sizes[t][0] for t in subset), max(sizes[t][1] for t in subset)))
        return [max((min(self.profiles[t].samples_per_s(n, -(-n // per_node)) for t in subset)
                     for subset, gpus, per_node in subsets if gpus >= n), default=0.0)
                for n in range(1, max_gpus + 1)]

    def speed_on(self, gpus: Sequence[GpuId]) -> float:
        """Samples/s on ``gpus``: the type's measured speed, or on several types the slowest
        type's per-GPU speed times the GPU count (every worker keeps the slowest one's pace)."""
        n, num_nodes = len(gpus), len({g.node for g in gpus})
        types = {self.node_types[g.node] for g in gpus}
        key = (min(types) if len(types) == 1 else ",".join(sorted(types)), n, num_nodes)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = min(self.profiles[t].samples_per_s(n, num_nodes) for t in types)
        return hit


@dataclass(frozen=True)
class TypedProfileSet:
    """The models measured on every type of a mixed cluster (names as :data:`MODEL_ALIASES` map them)."""

    cluster: MixedCluster
    sets: Mapping[str, ProfileSet]
    names: Mapping[str, Mapping[str, str]]  # type -> common model name -> that type's profile name
    source: str = "mixed"
    _node_types: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def profiles(self) -> dict[str, TypedProfile]:
        first = next(iter(self.names.values()))
        return {m: self[m] for m in sorted(first)}

    def __getitem__(self, model: str) -> TypedProfile:
        if not self._node_types:
            self._node_types.update((n.name, n.gpu_type) for n in self.cluster.node_states())
        try:
            by_type = {t: self.sets[t][self.names[t][model]] for t in self.cluster.gpu_types}
        except KeyError:
            known = ", ".join(sorted(next(iter(self.names.values()))))
            raise ProfileError(f"model {model!r} is not measured on every type of {self.cluster}; "
                               f"known on all: {known} (cut the workload with `airflow-elastic-gpu "
                               f"workload --cluster {self.cluster}` to draw its models among them)") from None
        return TypedProfile(model, by_type, self._node_types)

    def assign(self, model: str | None, gpu_time_s: float, rng: random.Random) -> TypedProfile:
        """The job's ``model`` if given, else one drawn (seeded): by GPU-time among Pollux's models
        measured on every type (as :meth:`ProfileSet.assign`), else uniformly."""
        if model:
            return self[model]
        common = next(iter(self.names.values()))
        buckets = [(bound, [m for m in names if m in common]) for bound, names in POLLUX_MODELS_BY_GPU_HOURS]
        buckets = [(bound, names) for bound, names in buckets if names]
        if buckets:
            hours = gpu_time_s / 3600.0
            names = next((names for bound, names in buckets if hours < bound), buckets[-1][1])
            return self[rng.choice(names)]
        return self[rng.choice(sorted(common))]


def load_typed_profiles(cluster: MixedCluster, path: str | Path | None = None) -> TypedProfileSet:
    """Every type's profiles (:data:`SOURCE_OF_TYPE`), restricted to the models measured on all types.

    :raises ProfileError: a type no source measured, or no model common to all types.
    """
    sets, names = {}, {}
    for t in cluster.gpu_types:
        if t not in SOURCE_OF_TYPE:
            raise ProfileError(f"no throughput profiles for GPU type {t!r}; known: {', '.join(SOURCE_OF_TYPE)}")
        source = SOURCE_OF_TYPE[t]
        sets[t] = load_profiles(path, source, t)
        aliases = MODEL_ALIASES.get(source, {})
        names[t] = {aliases.get(m, m): m for m in sets[t].profiles}
    common = set.intersection(*(set(n) for n in names.values()))
    if not common:
        raise ProfileError(f"no model is measured on every type of {cluster}")
    return TypedProfileSet(cluster, sets, {t: {m: n[m] for m in sorted(common)} for t, n in names.items()})


def default_profiles(cluster: ClusterShape | MixedCluster) -> ProfileSet | TypedProfileSet:
    """The bundled profiles for ``cluster``: Pollux T4 for one type, :func:`load_typed_profiles` for several."""
    return load_typed_profiles(cluster) if isinstance(cluster, MixedCluster) else load_profiles()
