"""The one small interface every scheduling policy implements, and the registry of policies by name."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from airflow_elastic_gpu.scheduling.state import ClusterState, Decision

log = logging.getLogger(__name__)
_WARNED: set[str] = set()  # stored settings already warned about (a pool rebalances every few seconds)


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


def stored_policy(name: str, params: Mapping[str, Any] | None) -> Policy:
    """The policy a pool's stored settings name (:func:`get_policy`), never refused over a parameter
    stored by an earlier version: one the policy no longer takes (``elastic``, which said what a
    policy is and set nothing) is left out, and stored values no longer valid give way to the
    policy's defaults; each is logged once. The pool's scheduling stopped instead, every rebalance
    refused, until its settings were given again.

    :raises ValueError: unknown policy name.
    """
    accepted = _parameters(_policy_class(name))
    params = dict(params or {})
    dropped = sorted(set(params) - set(accepted))
    kept = {k: v for k, v in params.items() if k in accepted}
    try:
        policy = get_policy(name, **kept)
        problem = f"parameters it no longer takes left out: {', '.join(dropped)}" if dropped else ""
    except ValueError as exc:
        policy, problem = get_policy(name), f"{exc}; its defaults serve"
    if problem and (said := f"{name} {sorted(params.items())!r}") not in _WARNED:
        _WARNED.add(said)
        log.warning("the stored settings of policy %r: %s (set them again: airflow-elastic-gpu pool --param ...)",
                    name, problem)
    return policy
