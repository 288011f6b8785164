"""The adaptive policy's reason lines: one per job whose GPUs a decision changes, written when read."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from airflow_elastic_gpu.scheduling.state import GpuId, JobState


class Reasons(Mapping[str, str]):
    """:meth:`~airflow_elastic_gpu.scheduling.adaptive.AdaptivePolicy._reasons`' lines, written on first read."""

    def __init__(self, changed: dict[str, int], order: list[JobState],
                 allocations: Mapping[str, tuple[GpuId, ...]], hysteresis: str) -> None:
        self._changed, self._order, self._allocations, self._hysteresis = changed, order, allocations, hysteresis
        self._lines: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._changed)

    def __iter__(self) -> Iterator[str]:
        return iter(self._changed)

    def __getitem__(self, job_id: str) -> str:
        line = self._lines.get(job_id)
        if line is None:
            line = self._lines[job_id] = self._line(self._changed[job_id])  # KeyError: unchanged
        return line

    def _line(self, r: int) -> str:
        order = self._order
        j = order[r]
        num_gpus, new = len(j.allocation), self._allocations[j.job_id]
        size = len(new)
        if not num_gpus:
            verb = "resume from its checkpoint" if j.suspended else "start"
            return f"{verb} on {size} GPU(s)"
        if not size:
            return (
                f"suspend (checkpoint, stop, keep its place): predicted remaining time "
                f"{j.remaining_time_s(num_gpus):.0f}s; jobs with less remaining work start "
                f"(rank {r + 1} of {len(order)})"
            )
        if size == num_gpus:
            return f"move to {', '.join(map(str, new))} (placement)"
        before_s, after_s = j.remaining_time_s(num_gpus), j.remaining_time_s(size)
        if size > num_gpus:
            return (
                f"grow {num_gpus}->{size} GPUs: predicted remaining time "
                f"{before_s:.0f}s->{after_s:.0f}s, "
                f"gain {before_s - after_s:.0f}s > {self._hysteresis} x restart overhead "
                f"{j.restart_overhead_s:.0f}s"
            )
        if after_s < before_s:
            own_max = j.throughput.own_max_gpus
            who = "measured" if own_max is None or num_gpus <= own_max else "its family measured"
            return (
                f"shrink {num_gpus}->{size} GPUs: {who} faster on fewer GPUs, predicted "
                f"remaining time {before_s:.0f}s->{after_s:.0f}s"
            )
        return (
            f"shrink {num_gpus}->{size} GPUs: the GPUs gain more elsewhere "
            f"(rank {r + 1} of {len(order)} by remaining work)"
        )
