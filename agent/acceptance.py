"""Acceptance that resists noise: a challenger replaces the incumbent only when back-to-back
timings say it is faster with a stated confidence (docs/design.md §6).

One timing of each engine on a busy machine moves by a few percent, so a fixed margin over one
run both accepts noise and rejects real small gains. Instead:
  1. the screen: the challenger's first timing (public sequence and the run's benchmark, no
     stress) against the incumbent's recorded timing, case for case over the cases both timed
     (the conservative engine is timed on one: agent/judge.py CONSERVATIVE_CASE); below
     SCREEN_KEEP of it (the geometric mean of the paired ratios) it is "screened out"; at
     CLEAR_WIN or more in every common case it is accepted as it stands
     (repeated timings of one engine on an H100 spread by a few percent a case, the short
     prefill case by up to ~7%: docs/benchmarks.md, eighth session). A screen of one run a case
     can also be hit by a stall of the machine (an H200 host, twenty-third session: a case 2-3x
     slow, the judge's request reaching the worker 2-4 ms late), and such noise only ever slows
     a run. So a screen below SCREEN_KEEP that is at least as fast as the incumbent in some case
     (mixed evidence, not an engine slower across the board) is timed once more
     (`worth_timing_again`), and whether it is screened out is decided on each case's faster run
     (`fastest`); a clear win and the rounds take single runs only;
  2. rounds: the incumbent is timed again right after (and from the second round on, the two
     alternate order, ABBA, so a drift of the machine falls on both); every benchmark case of a
     round gives one paired ratio challenger / incumbent;
  3. the rule: a one-sided sign test on the paired ratios (H0: the challenger is no faster, each
     ratio above 1 with probability 1/2). Accepted when p <= ALPHA and the geometric mean of the
     ratios is above 1; rejected as "not faster" when that mean is at or below 1, and as "within
     noise (p=...)" once even a win in every remaining pair could not bring p to ALPHA. When the
     budget has no room to time the incumbent again, the first pair is the screen against the
     incumbent's recorded timing, and the reason says so.
The sign test assumes nothing about the noise's shape, only that a no-faster challenger wins a
pair at most half the time; cases of one round share the machine's state, which the ABBA order
and the fresh evaluator process per timing are there to break.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from agent.records import ACCEPTED, DEADLINE, EvalResult

ALPHA = 0.05          # the accepted risk of taking a no-faster engine for a faster one
SCREEN_KEEP = 0.9     # a first timing below this fraction of the incumbent's score ends the contest
MAX_ROUNDS = 3        # back-to-back pairs at most per challenger (each costs one timing of each)
CLEAR_WIN = 1.10      # a screen this much faster in every case is accepted without rounds

Timing = Callable[[str], EvalResult | None]   # (label) -> a timing run; None: no time left for one
SCREEN_AGAIN = "screen-again"                  # the folder of a screen's second run (worth_timing_again)


@dataclass(frozen=True)
class Decision:
    accepted: bool
    reason: str                       # what the log says: "faster: ...", "screened out: ...", ...
    ratio: float | None = None        # geometric mean challenger / incumbent over the pairs (or the screen)
    p: float | None = None            # the sign test's one-sided p, where pairs were timed
    failure: EvalResult | None = None # a timing of the challenger that failed: its verdict
    cut: bool = False                 # undecided for want of time (no pair left to time): not a verdict on it


def sign_p(wins: int, n: int) -> float:
    """P(at least `wins` of `n` fair coin flips come up heads): the one-sided sign test."""
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2 ** n if n else 1.0


def paired_log_ratios(challenger: EvalResult, incumbent: EvalResult) -> list[float]:
    """log(challenger / incumbent) tokens per second, one per benchmark case both timed (or of
    the scores, where either verdict carries no cases: scores over different cases never meet)."""
    a, b = challenger.tokens_per_second(), incumbent.tokens_per_second()
    ratios = [math.log(a[c] / b[c]) for c in a if c in b and a[c] > 0 and b[c] > 0]
    if (not a or not b) and challenger.rank() > 0 and incumbent.rank() > 0:
        ratios = [math.log(challenger.rank() / incumbent.rank())]
    return ratios


def speedup(challenger: EvalResult, incumbent: EvalResult) -> float | None:
    """challenger / incumbent: the geometric mean of the paired ratios over the cases both timed;
    None where they have none in common."""
    ratios = paired_log_ratios(challenger, incumbent)
    return math.exp(sum(ratios) / len(ratios)) if ratios else None


def worth_timing_again(screen: EvalResult, incumbent: EvalResult | None) -> bool:
    """Whether a passing screen is below SCREEN_KEEP of the incumbent yet at least as fast in
    some case both timed: what a stall in one or two of its single runs looks like."""
    if incumbent is None or not incumbent.passed or incumbent.rank() <= 0 or not screen.passed:
        return False   # (an incumbent with no timed score is beaten by any screen: contest says so)
    ratios = paired_log_ratios(screen, incumbent)
    return bool(ratios) and math.exp(sum(ratios) / len(ratios)) < SCREEN_KEEP and max(ratios) >= 0


def fastest(first: EvalResult, again: EvalResult) -> EvalResult:
    """`again` with each benchmark case the faster of its two runs (rows of `first` where `again`
    did not time the case): the screen's decision, and the timing a final without a benchmark of
    its own takes (agent/loop.py joined). Timing noise only slows a run."""
    rows = {c.get("case_name"): c for c in first.benchmark}
    for c in again.benchmark:
        old = rows.get(c.get("case_name"))
        if old is None or float(c.get("tokens_per_second") or 0) >= float(old.get("tokens_per_second") or 0):
            rows[c.get("case_name")] = c
    fractions = [float(c.get("floor_fraction") or 0) for c in rows.values()]
    score = (math.exp(sum(map(math.log, fractions)) / len(fractions)) if fractions and min(fractions) > 0
             else again.score)   # the evaluator's score (geometric mean of floor fractions) of these rows
    return replace(again, benchmark=list(rows.values()), score=score)


def percent(ratio: float) -> str:
    return f"{100 * ratio:.0f}% of best"


def order() -> list[tuple[str, bool]]:
    """Every repeated timing `contest` may ask for, in the order it asks: (label, True for the
    challenger), so that they can be run ahead of the asking (agent/judge.py Series)."""
    labels = [("incumbent-1", False)]
    for round_ in range(2, MAX_ROUNDS + 1):
        pair = [(f"incumbent-{round_}", False), (f"challenger-{round_}", True)]
        labels += pair if round_ % 2 == 0 else pair[::-1]
    return labels


def contest(screen: EvalResult, incumbent: EvalResult | None, time_challenger: Timing,
            time_incumbent: Timing, again: EvalResult | None = None) -> Decision:
    """Decide on a challenger whose screen passed (and kept a safe margin). `time_*` run one more
    timing of each engine (stress off) and may return None when the budget has no room for it.
    `again`: the screen's second run (worth_timing_again); whether it is screened out is then
    decided on each case's faster run, while a clear win and the rounds take single runs: the
    second run alone is the challenger's half of the first round (the faster of two draws would
    tilt them towards the challenger)."""
    if incumbent is None or not incumbent.passed or incumbent.rank() <= 0:
        return Decision(True, f"{ACCEPTED}: the incumbent has no timed score")
    kept, twice = (screen, "") if again is None else (fastest(screen, again), ", the faster of two runs a case")
    first = speedup(kept, incumbent)   # None: no case in common; the rounds time both alike
    if first is not None and first < SCREEN_KEEP:
        return Decision(False, f"screened out: {percent(first)}{twice}{_over(screen, incumbent)}", first)
    screen = screen if again is None else again
    single = speedup(screen, incumbent)
    if single is not None and min(paired_log_ratios(screen, incumbent)) >= math.log(CLEAR_WIN):
        return Decision(True, f"{ACCEPTED}: {percent(single)} on the screen, every case at least {CLEAR_WIN:g}x "
                        f"the best's recorded timing (past any timing noise){_over(screen, incumbent)}", single)
    samples: list[float] = []
    stale = ""
    for round_ in range(1, MAX_ROUNDS + 1):
        if round_ == 1:   # the screen was the challenger's half of the first pair
            again = time_incumbent(f"incumbent-{round_}")
            if again is None:
                again, stale = incumbent, "; paired with the best's recorded timing (no time to time it again)"
            pair = (screen, again)
        elif round_ % 2 == 0:
            inc = time_incumbent(f"incumbent-{round_}")
            pair = (time_challenger(f"challenger-{round_}") if inc else None, inc)
        else:
            mine = time_challenger(f"challenger-{round_}")
            pair = (mine, time_incumbent(f"incumbent-{round_}") if mine and mine.passed else None)
        mine, theirs = pair
        if theirs is not None and theirs.error_kind == DEADLINE:   # the budget ran out under it: no time left
            theirs = None
        if mine is not None and not mine.passed:
            return Decision(False, f"a repeated timing failed: {mine.stage}/{mine.error_kind}", failure=mine)
        if mine is not None and not mine.safe():   # its timed runs took another path (EvalResult.margin)
            return Decision(False, f"a repeated timing's margin {mine.margin():.2f} is below the "
                                   f"{mine.required_margin():.2f} asked for")
        if mine is None or theirs is None or not theirs.passed:
            no_time = theirs is None or mine is None
            decision = _verdict(samples, final=True, why=("no time left for another pair" if no_time else
                                "the incumbent's repeated timing did not pass") + stale)
            undecided = not decision.accepted and (decision.ratio is None or decision.ratio > 1.0)
            return replace(decision, cut=no_time and undecided)
        samples += paired_log_ratios(mine, theirs)
        per_round = max(len(paired_log_ratios(mine, theirs)), 1)
        decision = _verdict(samples, final=round_ == MAX_ROUNDS, remaining=per_round * (MAX_ROUNDS - round_))
        if decision is not None:
            return Decision(decision.accepted, decision.reason + stale, decision.ratio, decision.p)
    raise AssertionError("unreachable: the last round always decides")


def _over(screen: EvalResult, incumbent: EvalResult) -> str:
    """' (over mixed, the cases both timed)' where the two verdicts timed different cases."""
    a, b = screen.tokens_per_second(), incumbent.tokens_per_second()
    common = [c for c in a if c in b]
    return f" (over {', '.join(common)}, the cases both timed)" if a and b and a.keys() != b.keys() else ""


def _verdict(samples: list[float], final: bool, remaining: int = 0, why: str = "") -> Decision | None:
    """Accept, reject, or None: another round could still decide."""
    if not samples:
        return Decision(False, f"not timed against the incumbent: {why or 'no benchmark case in common'}")
    ratio = math.exp(sum(samples) / len(samples))
    wins, n = sum(1 for s in samples if s > 0), sum(1 for s in samples if s != 0)
    p = sign_p(wins, n)
    counted = f"{wins}/{n} paired timings faster, sign test p={p:.3g}"
    if ratio <= 1.0:
        return Decision(False, f"not faster: {percent(ratio)} ({counted})", ratio, p)
    if p <= ALPHA:
        return Decision(True, f"{ACCEPTED}: {percent(ratio)}, {counted}", ratio, p)
    if final or sign_p(wins + remaining, n + remaining) > ALPHA:
        return Decision(False, f"within noise: {percent(ratio)}, but {wins}/{n} paired timings faster is not "
                               f"enough to tell (sign test p={p:.3g} > {ALPHA:g})"
                        + (f"; {why}" if why else ""), ratio, p)
    return None
