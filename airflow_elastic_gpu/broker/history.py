"""What a pool's events say its jobs went through: the resizes their trainers really ran.

A resize is *published* (event ``resize``) when the broker picks another GPU set, and *applied* when
the job's agent acks that generation (event ``ack``). A published generation that a later one replaces
before its ack never ran, so it is not a resize of the job. :func:`applied_resizes` counts exactly
what :attr:`JobView.num_resizes <airflow_elastic_gpu.broker.types.JobView.num_resizes>` counts (every
ack after a job's first, the rule of :func:`airflow_elastic_gpu.scheduling.core.apply_ack`); the
demo's summary, the API's timeline and the GPU pool page all use it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from airflow_elastic_gpu.broker.types import EventView
from airflow_elastic_gpu.states import PUBLISH_KINDS, EventKind


@dataclass(frozen=True)
class AppliedResize:
    """A job's trainer restarted on another GPU set.

    :param time_s: when the trainer ran on the new set (the ack), seconds since the epoch.
    :param from_gpus: GPUs of the generation it ran before, ``to_gpus`` of this one.
    :param ack: the ack event; ``published``: the event that published the generation (its reason), or
        None when it is not among the events given.
    """

    job_id: str
    time_s: float
    generation: int
    from_gpus: int
    to_gpus: int
    ack: EventView
    published: EventView | None

    @property
    def grew(self) -> bool:
        return self.to_gpus > self.from_gpus

    @property
    def shrank(self) -> bool:
        return self.to_gpus < self.from_gpus


def applied_resizes(events: Iterable[EventView]) -> list[AppliedResize]:
    """The resizes that ``events`` (oldest first, any mix of jobs) show applied, in ack order."""
    published: dict[tuple[str, int], EventView] = {}
    running_on: dict[str, int] = {}  # job -> GPUs of its latest acked generation
    out: list[AppliedResize] = []
    for e in events:
        if e.job_id is None or not e.data:
            continue
        generation = int(e.data.get("generation", 0))
        if e.kind in PUBLISH_KINDS:
            published[(e.job_id, generation)] = e
        elif e.kind == EventKind.ACK:
            to_gpus = int(e.data.get("num_gpus", 0))
            if e.job_id in running_on:
                out.append(AppliedResize(e.job_id, e.time_s, generation, running_on[e.job_id], to_gpus, e,
                                         published.get((e.job_id, generation))))
            running_on[e.job_id] = to_gpus
    return out
