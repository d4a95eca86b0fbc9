"""Finding the request that makes every engine step fail, so that it fails alone.

Why: ``LLMEngine.step()`` recovers before it re-raises (every sequence committed or
preempted), but it does not say which request was at fault; a request that breaks the
step each time it is in the batch (a fault the engine's own checks did not catch) would
otherwise make the loop fail every request in flight.

The policy, decided here without touching the engine (``routes`` carries it out):

* a failed step is retried; only ``threshold`` failures in a row make a suspicion;
* the suspects are the requests whose client has seen nothing yet (not streamed, or
  streamed without any output so far): they can be taken out of the engine and run again
  from their prompt without the client noticing, so they are *parked* (aborted in the
  engine, kept by the loop). Those that have not yet produced a token in a successful
  step are parked first, then the others;
* once a step succeeds without them (or the engine has nothing else to do), the parked
  requests go back in groups, bisecting: half of the group known to hold the culprit is
  re-added; if ``threshold`` failures follow, the culprit is in that half (parked again
  and split), else in the other half. A group of one that fails is the culprit: it alone
  ends with an error. A group is cleared once each member has ended: a request may break
  the steps only after its first tokens, so a token proves nothing (a group cleared at
  its first tokens would be parked and re-added for ever);
* when no suspect is left (every request in flight has streamed output, which cannot be
  taken back), the newest request is failed, one per ``threshold`` failures, until the
  steps succeed.

Costs: nothing while steps succeed; ``threshold`` failed steps per bisection round, so a
culprit among ``k`` suspects is found after about ``threshold * (log2(k) + 2)`` failed
steps, and a parked request that is not the culprit only waits (it is recomputed from
its prompt, so seeded and greedy requests give the same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Suspect:
    """A request in the engine, as the quarantine sees it (in admission order)."""

    request_id: str
    rerunnable: bool
    """Its client has seen nothing: it may be parked and run again from its prompt."""
    confirmed: bool
    """It produced a token in a successful step since it was (re-)added."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the loop does after a failed step: ``park`` these requests (abort them in the
    engine, keep them to re-add), or ``fail`` these (abort them, end them with an error).
    Both empty: just step again."""

    park: tuple[str, ...] = ()
    fail: tuple[str, ...] = ()


@dataclass(slots=True)
class Quarantine:
    """The bisection's state (see the module docstring); one per engine loop."""

    threshold: int
    failures: int = 0
    """Consecutive failed steps since the last success or verdict."""
    parked: list[str] = field(default_factory=list)
    guilty: int | None = None
    """``parked[:guilty]`` is believed to hold a culprit (if ``probe`` is cleared); None:
    no part is suspected more than another."""
    probe: list[str] = field(default_factory=list)
    """The parked requests re-added last that have not ended yet."""
    settled: bool = True
    """A step has succeeded since the last verdict."""

    def failed(self, suspects: list[Suspect]) -> Verdict:
        """A step failed with ``suspects`` in the engine (oldest first)."""
        self.failures += 1
        if self.failures < self.threshold:
            return Verdict()
        self.failures = 0
        self.settled = False
        if self.probe:
            probe, self.probe = self.probe, []
            if len(probe) == 1:  # the culprit: the others are presumed innocent
                self.guilty = None
                return Verdict(fail=tuple(probe))
            self.parked[:0] = probe
            self.guilty = len(probe)
            return Verdict(park=tuple(probe))
        fresh = [s.request_id for s in suspects if s.rerunnable and not s.confirmed]
        group = fresh or [s.request_id for s in suspects if s.rerunnable]
        if group:
            self.parked[:0] = group
            self.guilty = len(group)
            return Verdict(park=tuple(group))
        if suspects:
            return Verdict(fail=(suspects[-1].request_id,))
        return Verdict()

    def succeeded(self) -> None:
        """A step succeeded."""
        self.failures = 0
        self.settled = True

    def gone(self, request_id: str) -> None:
        """The request ended (finished, aborted, failed): it is no one's suspect now."""
        if request_id in self.parked:
            at = self.parked.index(request_id)
            del self.parked[at]
            if self.guilty is not None and at < self.guilty:
                self.guilty = self.guilty - 1 or None
        if request_id in self.probe:
            self.probe.remove(request_id)

    def release(self, idle: bool) -> list[str]:
        """The parked requests to re-add now (the next probe), or []: only once a step
        has succeeded since the last verdict, or when the engine has nothing else."""
        if self.probe or not self.parked or not (self.settled or idle):
            return []
        k = -(-self.guilty // 2) if self.guilty else len(self.parked)
        self.probe, self.parked = self.parked[:k], self.parked[k:]
        self.guilty = (self.guilty - k or None) if self.guilty else None
        return list(self.probe)

    def clear(self) -> None:
        """Forget everything (the loop failed every request)."""
        self.failures = 0
        self.parked.clear()
        self.probe.clear()
        self.guilty = None
        self.settled = True
