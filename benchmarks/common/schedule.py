"""A load step's schedule of callers over time, and each client process's share of it.

A schedule is `time_s:callers` points, e.g. "0:0,30:96,230:96,260:0,320:0": the callers change
linearly between consecutive points (0 -> 96 over the first 30 s), a time given twice is a step
("0:0,30:0,30:96": none for 30 s, then 96 at once), and the last point's time is the run's length.
Callers are whole: the interpolated count is rounded to the nearest."""

from __future__ import annotations

from dataclasses import dataclass

Schedule = tuple[tuple[float, int], ...]


def parse_schedule(text: str) -> Schedule:
    """`"t:n,t:n,..."` as ((t, n), ...); ValueError naming the point and the rule it breaks."""
    points = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        time_s, sep, callers = part.partition(":")
        try:
            point = (float(time_s), int(callers))
        except ValueError:
            point = None
        if not sep or point is None:
            raise ValueError(f"schedule point {part!r}: expected seconds:callers, e.g. 30:96")
        if point[0] < 0 or point[1] < 0:
            raise ValueError(f"schedule point {part!r}: seconds and callers must be >= 0")
        if points and point[0] < points[-1][0]:
            raise ValueError(f"schedule point {part!r}: times must not decrease (after {points[-1][0]:g} s)")
        points.append(point)
    if len(points) < 2 or points[-1][0] <= 0:
        raise ValueError(f"schedule {text!r}: at least two points, the last one after 0 s (the run's length)")
    return tuple(points)


def callers_at(schedule: Schedule, elapsed: float) -> int:
    """Callers the schedule asks for `elapsed` seconds into the run (a step takes its later count
    from its time on; before the first point the first count, after the last the last count)."""
    if elapsed < schedule[0][0]:
        return schedule[0][1]
    for (t0, n0), (t1, n1) in zip(schedule, schedule[1:]):
        if t0 <= elapsed < t1:
            return round(n0 + (n1 - n0) * (elapsed - t0) / (t1 - t0))
    return schedule[-1][1]


def mean_callers(schedule: Schedule, start: float, end: float, steps: int = 50) -> float:
    """The schedule's callers averaged over [start, end) (a window's load, steps included)."""
    width = (end - start) / steps
    return sum(callers_at(schedule, start + (i + 0.5) * width) for i in range(steps)) / steps


def peak(schedule: Schedule) -> int:
    """The most callers the schedule ever asks for."""
    return max(n for _, n in schedule)


def shares(concurrency: int, processes: int) -> list[int]:
    """`concurrency` callers split over `processes` as evenly as they go."""
    return [concurrency // processes + (p < concurrency % processes) for p in range(processes)]


@dataclass(frozen=True)
class ScheduleShare:
    """Client process `process` of `processes`: which of its callers send at a time into the run
    (its share of the schedule's callers, the lowest-numbered callers first)."""

    schedule: Schedule
    process: int
    processes: int

    def callers(self, elapsed: float) -> int:
        return shares(callers_at(self.schedule, elapsed), self.processes)[self.process]

    def most(self) -> int:
        """Callers this process needs at the schedule's peak (shares never shrink as the total grows)."""
        return shares(peak(self.schedule), self.processes)[self.process]

    def __call__(self, caller: int, elapsed: float) -> bool:
        return caller < self.callers(elapsed)
