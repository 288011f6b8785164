"""The one small interface every scheduling policy implements, and the registry of policies by name."""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

from airflow_elastic_gpu.scheduling.state import ClusterState, Decision


@runtime_checkable
class Policy(Protocol):
    """A pure function from cluster state to target allocations.

    ``decide`` must not do I/O or read a clock: the time is ``cluster.now_s``.
    It returns an allocation for every job in ``cluster.jobs``; running jobs
    keep at least ``min_gpus``; no GPU goes to two jobs.
    """

    name: str
    elastic: bool
    preemptive: bool  # may take every GPU from a running job (simulation only; the broker keeps >= min)
    resize_mechanism: str  # "inplace" (sidecar restart), "recreate" (new pod), or "none"

    def decide(self, cluster: ClusterState) -> Decision: ...


def policy_classes() -> dict[str, type]:
    """Every policy by name: ours (``adaptive``), the baselines and the peers from the literature."""
    from airflow_elastic_gpu.scheduling.adaptive import AdaptivePolicy
    from airflow_elastic_gpu.scheduling.afs_l import AfsLPolicy
    from airflow_elastic_gpu.scheduling.gavel import GavelPolicy
    from airflow_elastic_gpu.scheduling.optimus import OptimusPolicy
    from airflow_elastic_gpu.scheduling.static import StaticPolicy
    from airflow_elastic_gpu.scheduling.termination import TerminationPolicy
    from airflow_elastic_gpu.scheduling.tiresias import TiresiasPolicy

    return {
        "adaptive": AdaptivePolicy,
        "static": StaticPolicy,
        "termination": TerminationPolicy,
        "tiresias": TiresiasPolicy,
        "optimus": OptimusPolicy,
        "afs_l": AfsLPolicy,
        "gavel": GavelPolicy,
    }


def get_policy(name: str, /, **params: Any) -> Policy:
    """Build the policy called ``name`` with keyword ``params``.

    :raises ValueError: unknown name (the message lists the known ones), or bad params.
    """
    cls = _policy_class(name)
    accepted = _parameters(cls)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"bad parameters for policy {name!r}: unknown {', '.join(map(repr, unknown))}; "
            + (f"its parameters: {', '.join(accepted)}" if accepted else "it takes none")
        )
    try:
        return cls(**params)
    except TypeError as exc:
        raise ValueError(f"bad parameters for policy {name!r}: {exc}") from None


def policy_parameters(name: str) -> list[str]:
    """The keyword parameters of the policy called ``name`` (its name aside), in declaration order.

    :raises ValueError: unknown name.
    """
    return _parameters(_policy_class(name))


def _policy_class(name: str) -> type:
    """:raises ValueError: unknown name (the message lists the known ones)."""
    known = policy_classes()
    try:
        return known[name]
    except KeyError:
        raise ValueError(
            f"unknown scheduling policy {name!r}; choose one of {', '.join(sorted(known))}"
        ) from None


def _parameters(cls: type) -> list[str]:
    """The keyword parameters a policy class takes (its name and ``elastic``, which says what the
    policy is and sets nothing, aside), in declaration order."""
    return [p.name for p in inspect.signature(cls).parameters.values()
            if p.name not in ("name", "elastic") and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
