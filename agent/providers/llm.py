"""The LLM proposer: a model writes (and repairs) kernel variants, or proposes a plan change
from the library; every answer is checked before it becomes a candidate.

It wraps the builtin proposer and takes turns with it: the builtin walk goes first (it
gets the KV-cache engine judged, the basis every kernel slot needs), then an LLM episode,
then the builtin again, and so on; once the builtin has nothing left the LLM goes on alone.
When the provider is unreachable, refuses the key, keeps failing, or the budget is spent,
the LLM side stops, says why in the log, and the builtin proposer carries the run alone.

An episode: pick the slot with the largest share of the time (fewest attempts first on a
tie), render the prompt (templates/prompts/), ask, check the answer
(agent/providers/proposals.py: extraction, syntax, policy, unit check against the slot's
reference op, then its time against the current variant at the engine's call shapes), and
on a rejection send the verdict back for a bounded number of repair rounds. A correct answer
that timed clearly slower goes back with its numbers for a bounded number of refinement
rounds (the strongest signal a kernel writer gets); the fastest correct answer of the episode
becomes the Candidate; the loop then judges the whole engine and `feedback` records faster /
slower / wrong, with the unit timings, for the next prompt's history.
"""
from __future__ import annotations

import os
import re
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agent.archive import Archive
from agent.plan import ENGINES, Plan
from agent.providers import prompts
from agent.providers.budget import Budget, MeteredClient, Usage
from agent.providers.chat import (AUTH, BUDGET, REPLAY, UNREACHABLE, ChatClient, ChatError,
                                  DeadlineClient, Log, RecordingClient, RetryingClient, cut, shown_url)
from agent.providers.prices import price_for
from agent.providers.replay import TimingTape
from agent.providers.proposals import (DUPLICATE, NO_CODE, TimingRequest, Verdict, check_kernel_answer,
                                       check_plan_answer, code_digest)
from agent.records import ACCEPTED, Candidate, EvalResult, Proposer, SearchState, improves
from agent.workspace import RESULTS_LOG  # a file name: workspace.py imports nothing of the agent
from evaluator.slot_render import render_slot_module
from evaluator.slot_shapes import timed_shapes
from evaluator.slots import SLOT_FUNCTIONS, SLOTS

TRANSCRIPTS = "transcripts"
KERNEL, PLAN = "kernel", "plan"          # episode kinds
LLM_TURN, BUILTIN_TURN = "llm", "builtin"
# Errors after which asking again is pointless for the rest of the run.
FATAL = frozenset({AUTH, BUDGET, REPLAY, UNREACHABLE})
DETAIL_CHARS = 600   # of a verdict's detail, in the history that goes into the next prompt
LOG_CHARS = 300      # of a verdict's detail, in the log line
# Of a verdict's detail, in the repair or refinement round that sends it back: a unit check's output
# (12 lines of any length: an exception holding 2 MB, or the check's result line forged) or a plan
# naming 10000 unknown slots made that request hundreds of thousands of tokens, and the token budget's
# refusal of the next one stopped the model for the rest of the run (red-team helper, thirty-eighth session).
FEEDBACK_CHARS = 4000
SEED_STRIDE = 7919   # unit-check seeds: run seed * stride + check number
HISTORY_LINES = 12   # most recent attempts shown in a prompt, to bound its size
EVAL_RESERVE_S = 60.0  # run time kept free after a request, for judging what it produced
MIN_UNIT_CHECK_S = 5.0  # a unit check's timeout when the run has less left (its own start takes seconds)
VARIANT_PREFIX = "llm_"   # a model-written variant's name: the prefix and a number, unique within a run
VARIANT_NAME = re.compile(VARIANT_PREFIX + r"(\d+)")
# Episodes each graph-blocking slot gets first on a GPU (_choose_slot): while the best engine's
# decode or prefill attention cannot be captured, every pass runs eagerly and no other kernel
# shows its worth (a scripted good model's run from all-torch, twenty-third session: four slots
# written and judged, none faster, the attention slots never asked for).
BLOCKING_TRIES = 2


@dataclass
class LLMSettings:
    model: str
    timeout: float = 180.0          # seconds per request (reasoning models think for minutes)
    max_tokens: int = 16000         # per answer, reasoning included
    repair_rounds: int = 3          # answers after a rejected one, per episode
    refine_rounds: int = 2          # answers after a correct but slower one, per episode
    retries: int = 3                # per request, on rate limits, server errors, timeouts, empty answers
    retry_delay: float = 2.0        # first backoff, doubled each retry
    plan_every: int = 4             # every n-th episode asks for an engine-level plan change
    max_failed_episodes: int = 4    # episodes in a row with nothing usable: pause until a faster engine
    max_pauses: int = 2             # ... and after this many pauses, stop asking
    max_failed_calls: int = 2       # episodes in a row that got no answer at all: stop asking
    unit_check_timeout: float = 300.0
    kernels_on_cpu: bool = False    # on CPU the engine runs the torch variants, so kernels cannot win


def _best_key(state: SearchState) -> str | None:
    """The engine the loop holds as its best now (what a paused model waits to see change)."""
    return state.best.key() if state.best is not None else None


def _best_score(state: SearchState) -> float:
    return state.best_result.rank() if state.best_result is not None else 0.0


def chat_settings(options, model_env: str, default_model: str) -> LLMSettings:
    """Settings from the options the loop passes (`model`, when it has one), then the environment."""
    env = os.environ
    model = getattr(options, "model", None) or env.get(model_env) or default_model
    s = LLMSettings(model=model)
    for attr, var, kind in (("timeout", "LLM_TIMEOUT_S", float), ("max_tokens", "LLM_MAX_OUTPUT_TOKENS", int),
                            ("repair_rounds", "LLM_REPAIR_ROUNDS", int), ("refine_rounds", "LLM_REFINE_ROUNDS", int),
                            ("retries", "LLM_RETRIES", int),
                            ("retry_delay", "LLM_RETRY_DELAY_S", float), ("plan_every", "LLM_PLAN_EVERY", int),
                            ("unit_check_timeout", "LLM_UNIT_CHECK_TIMEOUT_S", float)):
        if env.get(var):
            setattr(s, attr, kind(env[var]))
    s.kernels_on_cpu = env.get("LLM_KERNELS_ON_CPU", "") not in ("", "0")
    return s


def workspace_log(workspace: Path) -> Log:
    """Until the loop hands us its reporter: lines to the console and to workspace/results.log."""

    def log(text: str) -> None:
        print(text, flush=True)
        try:
            with (Path(workspace) / RESULTS_LOG).open("a") as f:
                f.write(text + "\n")
        except OSError:
            pass
    return log


def transcript_path(workspace: Path, provider: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(workspace) / TRANSCRIPTS / f"{stamp}-{os.getpid()}-{provider}.jsonl"


def build_proposer(options, client: ChatClient, settings: LLMSettings, base_url: str | None = None, *,
                   record: bool = True, sleep=time.sleep, budget: Budget | None = None,
                   tape: TimingTape | None = None) -> "LLMProposer":
    """Stack the layers (transcript, budget, retries) around `client` and wrap the builtin proposer.
    `tape`: the replay's recorded unit timings; a recorded run writes its own into the transcript."""
    log = getattr(options, "log", None) or workspace_log(options.workspace)
    budget = budget or Budget.from_env()
    price, price_source = price_for(client.model)
    base_url = shown_url(base_url)
    inner: ChatClient = client
    where = "no transcript (replay)"
    if record:
        path = transcript_path(options.workspace, client.provider)
        inner = RecordingClient(DeadlineClient(client, settings.timeout), path,
                                {"base_url": base_url, "settings": asdict(settings), "budget": asdict(budget)})
        where = f"transcript {path}"
        tape = TimingTape(path=path)
    metered = MeteredClient(inner, budget, price)
    stack = RetryingClient(metered, log, retries=settings.retries, base_delay=settings.retry_delay, sleep=sleep,
                           request_timeout=settings.timeout)
    log(f"llm: provider {client.provider}, model {client.model}" + (f" at {base_url}" if base_url else "")
        + f"; price ${price.input_per_mtok}/${price.output_per_mtok} per M tokens in/out ({price_source})")
    log(f"llm: budget {budget.max_calls} calls, {budget.max_tokens} tokens, ${budget.max_cost_usd:.2f}"
        + (f", {budget.max_seconds:.0f}s" if budget.max_seconds else "") + f"; {where}")
    return LLMProposer(stack, options.builtin, options.device, log, settings, metered.usage,
                       label=f"{client.provider}:{client.model}", seed=options.seed, tape=tape or TimingTape())


@dataclass
class Attempt:
    """One line of the history the next prompt shows."""
    what: str
    verdict: str
    detail: str = ""


@dataclass
class _Pending:
    what: str
    baseline: EvalResult | None
    timing: str = ""     # the unit worker's timing summary of the judged answer


@dataclass
class _Episode:
    kind: str
    what: str
    messages: list[dict] = field(default_factory=list)
    slot: str = ""
    variant: str = ""
    timing: TimingRequest | None = None   # what a passed answer is timed against


def _timing_note(verdict: Verdict) -> str:
    """The log's note on a passed answer's unit timing."""
    if verdict.timing_error:
        return f" (not timed: {_first_line(verdict.timing_error, 120)})"
    ratio = verdict.ratio()
    return f" ({ratio:.2f}x the current variant's time at the call shapes)" if ratio is not None else ""


def _first_line(text: str, limit: int = LOG_CHARS) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + "…"


class LLMProposer:
    def __init__(self, client: ChatClient, fallback: Proposer, device: str, log: Log, settings: LLMSettings,
                 usage: Usage, label: str, seed: int = 0, tape: TimingTape | None = None):
        self.client = client
        self.tape = tape or TimingTape()
        self.seed = seed
        self.unit_checks = 0
        self.fallback = fallback
        self.device = device
        self.log = log
        self.settings = settings
        self.usage = usage
        self.origin = label
        self.name = f"llm({label})+{fallback.name}"
        self.active = True
        self.fallback_done = False
        self.last_turn = LLM_TURN         # the builtin walk goes first
        self.history: list[Attempt] = []
        self.episodes = 0
        self.variants_written = 0
        self.failed_episodes = 0
        self.failed_calls = 0
        self.pauses = 0
        self.paused_on: str | None = None   # paused: the best engine's key then; asked again once it changes
        self.attempts_per_slot = {s: 0 for s in SLOTS}
        self.variants: dict[tuple[str, str], str] = {}   # this run's unit-checked variants: template text
        self.codes: dict[tuple[str, str], str] = {}      # ... and their code as the model wrote it
        self.seen: dict[str, str] = {}                   # code digest -> which attempt sent it
        self._fallback_keys: set[str] = set()
        self._taken_over = False                         # _take_over: a resumed run's variants adopted
        self._pending: dict[str, _Pending] = {}
        self._won: dict[str, str] = {}   # key -> what: won its contest, its final deferred (agent/loop.py settle_final)
        self._deadline = 0.0                             # monotonic time the run's budget ends
        # agent/pipeline.py calls `ask` from several threads: everything above is changed under
        # this lock, which an episode lets go of only while its request is out (_unlocked).
        self._lock = threading.RLock()

    # --- the Proposer interface --------------------------------------------------------
    def propose(self, state: SearchState) -> Candidate | None:
        with self._lock:
            self._set_deadline(state)
            self._take_over(state)
            return self._propose(state)

    # --- the parallel pipeline's interface (agent/pipeline.py) ---------------------------
    def ready(self, state: SearchState) -> bool:
        """Whether a model episode can build on `state.best` now."""
        return self.active and not self.paused(state) and self._has_work(state)

    def ask(self, state: SearchState) -> Candidate | None:
        """One model episode on `state.best`, with no builtin turn (the pipeline draws the builtin
        itself). Safe to call from several threads at once: their requests overlap. None once the
        LLM side has stopped (another episode may have stopped it while this one waited)."""
        with self._lock:
            if not self.active or not self._awake(state):
                return None
            self._set_deadline(state)
            self._take_over(state)
            return self._guarded_episode(state)

    def _take_over(self, state: SearchState) -> None:
        """Once, at the first call: the variants a model wrote earlier in this run (a run continued
        with --resume: its history and its candidates still waiting), so that the plan menu lists
        them, new variants are not given their names (`llm_N`: a name already in a judged plan
        would make a new plan look judged), and the slots they were written for count as tried."""
        if self._taken_over:
            return
        self._taken_over = True
        earlier = {key: record.text for key, record in Archive.of(state).variants().items()}
        for waiting in state.waiting:   # checked before the interruption, their verdicts to come
            earlier.update(waiting.extra_variants)
        for (slot, name), text in earlier.items():
            if (slot, name) not in self.variants:
                self.variants[(slot, name)] = text
                self.attempts_per_slot[slot] = self.attempts_per_slot.get(slot, 0) + 1
            number = VARIANT_NAME.fullmatch(name)
            if number:
                self.variants_written = max(self.variants_written, int(number.group(1)))

    def _set_deadline(self, state: SearchState) -> None:
        """No request, retries included, may outlive the run (less the time to judge its answer)."""
        self._deadline = time.monotonic() + state.seconds_left
        if hasattr(self.client, "deadline"):
            self.client.deadline = self._deadline - EVAL_RESERVE_S

    @contextmanager
    def _unlocked(self):
        """Let other episodes go on while this one waits for its answer."""
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()

    def _propose(self, state: SearchState) -> Candidate | None:
        while True:
            llm_ready = self.active and self._awake(state) and self._has_work(state)
            if llm_ready and (self.fallback_done or self.last_turn != LLM_TURN):
                self.last_turn = LLM_TURN
                candidate = self._guarded_episode(state)
                if candidate is not None:
                    return candidate
                continue
            if not self.fallback_done:
                self.last_turn = BUILTIN_TURN
                candidate = self.fallback.propose(state)
                if candidate is not None:
                    self._fallback_keys.add(candidate.key())
                    return candidate
                if getattr(self.fallback, "waiting", False):   # nothing now, more after a verdict to come
                    if llm_ready:
                        continue
                    return None
                self.fallback_done = True
                if self.active and not self.paused(state):
                    self.log("llm: the builtin proposer has nothing left; the LLM goes on alone")
                continue
            if self.active:
                self._stop("the model is paused and nothing else is left to judge" if self.paused(state)
                           else "nothing left to ask for")
            return None

    def feedback(self, candidate: Candidate, result: EvalResult) -> None:
        with self._lock:
            self._feedback(candidate, result)

    def _feedback(self, candidate: Candidate, result: EvalResult) -> None:
        key = candidate.key()
        if key in self._fallback_keys:
            self._fallback_keys.discard(key)
            self.fallback.feedback(candidate, result)
            return
        pending = self._pending.pop(key, None)
        if pending is None:
            self._final_heard(key, result)
            return
        baseline = pending.baseline
        scores = f"score {result.rank():.4g} vs best {baseline.rank():.4g}" if baseline else f"score {result.rank():.4g}"
        if not result.passed:
            verdict, detail = "wrong in the whole engine", f"{result.stage}/{result.error_kind}: {result.error or ''}"
        elif result.decision is not None:   # the loop's acceptance (agent/acceptance.py) said why
            accepted = result.decision.startswith(ACCEPTED)
            verdict = "faster: accepted" if accepted else "correct but not faster: rejected"
            detail = f"{result.decision}; {scores}"
        elif improves(result, baseline):
            verdict, detail = "faster: accepted", scores
        else:
            verdict, detail = "correct but not faster: rejected", scores
        if pending.timing:
            detail += f"; unit timing: {pending.timing}"
        if verdict == "faster: accepted" and result.stress is None:   # a screen's win: the final comes later
            self._won[key] = pending.what
        self.log(f"llm: {pending.what} judged in the whole engine: {verdict} ({_first_line(detail)})")
        self.history.append(Attempt(pending.what, verdict, _first_line(detail, DETAIL_CHARS)))

    def _final_heard(self, key: str, result: EvalResult) -> None:
        """The deferred final of an engine the model was told had won: where it failed, the model
        hears that the engine was not kept (its history said "faster: accepted")."""
        what = self._won.pop(key, None)
        if what is None or (result.passed and (result.decision or "").startswith(ACCEPTED)):   # installed
            return
        detail = (f"{result.stage}/{result.error_kind}: {result.error or ''}" if not result.passed
                  else result.decision)
        self.log(f"llm: {what} won its contest, then its final in the whole engine did not hold: {_first_line(detail)}")
        self.history.append(Attempt(what, "won its contest, then failed its final: not kept",
                                    _first_line(detail, DETAIL_CHARS)))

    # --- turns --------------------------------------------------------------------------
    def _kernels_allowed(self) -> bool:
        return self.device == "cuda" or self.settings.kernels_on_cpu

    def _has_work(self, state: SearchState) -> bool:
        """The LLM needs a passing engine that uses slots to build on."""
        if state.best is None:
            return False
        return "kernel_blocks" in (ENGINES / f"{state.best.plan.engine}.py.j2").read_text()

    def _pause(self, state: SearchState, why: str) -> None:
        """Ask no more until the loop installs a new best engine, which gives the model new ground
        (a model that kept repeating the best engine's plan was dropped for the rest of a run whose
        engines then got 10x faster); after `max_pauses` pauses, stop. The mark is the search's
        best, not the top of the history: a screen that scored high and lost its contest is no new
        ground. A contest's winner whose final is deferred (agent/loop.py settle_final) is the
        search's best at once, so it wakes the model: the search builds on it meanwhile; if its
        final then fails, the model hears so and the best goes back."""
        if self.paused_on is not None or not self.active:   # another episode got here first
            return
        if self.pauses >= self.settings.max_pauses:
            self._stop(why)
            return
        self.pauses += 1
        self.paused_on = _best_key(state)
        self.log(f"llm: {why}; the model is asked again once a new best engine is installed (the best "
                 f"scores {_best_score(state):.4g} now; pause {self.pauses} of {self.settings.max_pauses}); "
                 "the builtin proposer goes on")

    def paused(self, state: SearchState) -> bool:
        """Paused, and the loop's best engine is still the one it was then."""
        mark = self.paused_on   # once: another thread's _awake may clear it meanwhile
        return mark is not None and _best_key(state) == mark

    def _awake(self, state: SearchState) -> bool:
        """False while paused; a new best engine ends the pause (said once) and the count of failures."""
        if self.paused_on is None:
            return True
        if self.paused(state):
            return False
        self.log(f"llm: a new best engine (score {_best_score(state):.4g}): asking the model again")
        self.paused_on = None
        self.failed_episodes = 0
        return True

    def _stop(self, why: str) -> None:
        """Ask no more; said once, whichever of the parallel episodes gets here first."""
        if not self.active:
            return
        self.active = False
        then = "the builtin proposer carries on alone" if not self.fallback_done else "the LLM proposer stops"
        self.log(f"llm: {why}; {then}. LLM totals: {self.usage.summary()}")

    def _next_kind(self) -> str:
        if not self._kernels_allowed():
            return PLAN
        return PLAN if self.episodes % self.settings.plan_every == 0 else KERNEL

    def _choose_slot(self, blocking: list[str], profile: prompts.Profile) -> str:
        """On a GPU, a slot whose current variant keeps the engine from capturing CUDA graphs
        (`blocking`, prompts.graph_blocking), for its first BLOCKING_TRIES episodes; then the
        largest share of the time per attempt on the slot so far. (min keeps graph_blocking's
        order among ties: decode first.)"""
        blocking = [s for s in blocking if self.attempts_per_slot[s] < BLOCKING_TRIES]
        if blocking:
            return min(blocking, key=lambda s: self.attempts_per_slot[s])
        return max(SLOTS, key=lambda s: (profile.share(s) / (1 + self.attempts_per_slot[s]), -SLOTS.index(s)))

    # --- one episode: ask, check, repair --------------------------------------------------
    def _guarded_episode(self, state: SearchState) -> Candidate | None:
        """An episode; a bug on the LLM side stops the LLM, never the run (the builtin goes on)."""
        try:
            return self._episode(state)
        except Exception:  # noqa: BLE001 - logged in full, then the builtin proposer carries on
            self.log(f"llm: internal error:\n{traceback.format_exc()}")
            self._stop("internal error in the LLM proposer (traceback above)")
            return None

    def _time_for_a_request(self) -> bool:
        left = self._deadline - time.monotonic()
        if left >= self.settings.timeout + EVAL_RESERVE_S:
            return True
        self._stop(f"{left:.0f}s of the run left, not enough for a request (up to {self.settings.timeout:.0f}s) "
                   "and the evaluation of its answer")
        return False

    def _episode(self, state: SearchState) -> Candidate | None:
        self.episodes += 1
        profile = prompts.profile(state.best_result)
        episode = self._start(state, profile, self._next_kind())
        rounds = 1 + self.settings.repair_rounds + (self.settings.refine_rounds if episode.kind == KERNEL else 0)
        repairs = refinements = 0
        slower: list[Verdict] = []      # correct answers that timed slower, kept in case none is faster
        verdict: Verdict | None = None
        for r in range(1, rounds + 1):
            if not self.active or not self._time_for_a_request():   # another episode may have stopped it
                return None
            if self.paused(state):   # ... or paused it: no repair or refinement goes out meanwhile
                self.log(f"llm: {episode.what}: the model is paused; no round {r}")
                return None
            try:
                with self._unlocked():
                    reply = self.client.complete(episode.messages, self.settings.max_tokens)
            except ChatError as e:
                self._call_failed(episode, e)
                return self._adopt(episode, min(slower, key=Verdict.ratio), state) if slower else None
            self.failed_calls = 0
            verdict = self._check(episode, reply.text, state)
            candidate = self._candidate(episode, verdict, state) if verdict.passed else None
            if verdict.passed and candidate is None:
                verdict = Verdict(DUPLICATE, "that exact candidate was already judged; propose something new")
            self.log(f"llm: {episode.what} round {r}/{rounds}: {verdict.verdict}"
                     + (f": {_first_line(verdict.detail)}" if verdict.detail else "") + _timing_note(verdict)
                     + f"  [{reply.input_tokens}+{reply.output_tokens} tokens; run total {self.usage.summary()}]")
            if verdict.code is not None:
                self.seen.setdefault(code_digest(verdict.code), f"the answer in round {r} of {episode.what}")
            if candidate is not None and verdict.slower():
                slower.append(verdict)
                if refinements < self.settings.refine_rounds and r < rounds:
                    refinements += 1
                    episode.messages += [{"role": "assistant", "content": reply.text},
                                         {"role": "user", "content": self._refine(episode, verdict, refinements)}]
                    continue
            if candidate is not None:
                return self._adopt(episode, min(slower, key=Verdict.ratio) if verdict.slower() else verdict, state)
            if repairs >= self.settings.repair_rounds or r == rounds:
                break
            repairs += 1
            episode.messages += [{"role": "assistant", "content": reply.text},
                                 {"role": "user", "content": self._repair(episode, verdict, r, rounds)}]
        if slower:   # every correct answer was slower at the unit level: the whole engine decides
            return self._adopt(episode, min(slower, key=Verdict.ratio), state)
        self.history.append(Attempt(episode.what, verdict.verdict, _first_line(verdict.detail, DETAIL_CHARS)))
        self.failed_episodes += 1
        if self.failed_episodes >= self.settings.max_failed_episodes:
            self._pause(state, f"{self.failed_episodes} episodes in a row produced nothing usable")
        return None

    def _adopt(self, episode: _Episode, verdict: Verdict, state: SearchState) -> Candidate | None:
        """`verdict`'s answer becomes this episode's candidate: its variant joins the run's."""
        if verdict.plan is None:
            key = (episode.slot, episode.variant)
            self.variants[key] = verdict.template
            self.codes[key] = verdict.code
        candidate = self._candidate(episode, verdict, state)
        if candidate is None:
            return None
        self.failed_episodes = 0
        timing = ""
        if verdict.timings and episode.timing is not None:
            timing = f"{verdict.ratio():.2f}x the time of `{episode.timing.current_name}` at the call shapes; " + \
                "; ".join(prompts.timing_lines(verdict.timings, episode.timing.current_name))
        self._pending[candidate.key()] = _Pending(episode.what, state.best_result, timing)
        return candidate

    def _call_failed(self, episode: _Episode, e: ChatError) -> None:
        self.log(f"llm: {episode.what}: no answer from {self.origin}: {e}")
        self.history.append(Attempt(episode.what, "no answer", e.kind))
        if e.kind in FATAL:
            self._stop(f"{e.kind}: {_first_line(e.message)}")
            return
        self.failed_calls += 1
        if self.failed_calls >= self.settings.max_failed_calls:
            self._stop(f"{self.failed_calls} requests in a row failed after retries (last: {e.kind})")

    def _start(self, state: SearchState, profile: prompts.Profile, kind: str) -> _Episode:
        best = state.best
        llm_names = {}
        for slot, name in self.variants:
            llm_names.setdefault(slot, []).append(name)
        common = {"hardware": prompts.hardware_facts(state), "model": state.spec.summary(),
                  "profile": profile, "history": self.history[-HISTORY_LINES:],
                  "plan_menu": prompts.plan_menu(state.device, llm_names), "judged": prompts.judged_lines(state)}
        if kind == PLAN:
            text = prompts.render("plan", best_plan_json=prompts.best_plan_json(best), **common)
            return _Episode(PLAN, f"plan change #{self.episodes}", [{"role": "user", "content": text}])
        blocking = prompts.graph_blocking(state, self.variants)
        slot = self._choose_slot(blocking, profile)
        self.attempts_per_slot[slot] += 1
        self.variants_written += 1
        name = VARIANT_PREFIX + str(self.variants_written)
        info = prompts.slot_info(slot, name)
        current = best.plan.slots.get(slot, "torch")
        model_variants = {**best.extra_variants, **self.variants}
        code = self.codes.get((slot, current)) or prompts.current_code(slot, current, best.plan.params, model_variants)
        self.seen.setdefault(code_digest(code), f"the current best variant {current}")
        system = prompts.render("system", variant=name, allowed_imports=prompts.allowed_imports())
        shapes = prompts.slot_shapes(state, slot)
        user = prompts.render("kernel", slot=info, variant=name, dtype=self._dtype(state),
                              best_plan=best.plan.describe(), current_variant=current, current_code=code.strip("\n"),
                              shapes=shapes[:prompts.SHAPES_SHOWN], measured=prompts.measured_shapes(state.best_result, slot),
                              fused_rows=prompts.fused_rows(state, slot),
                              blocking=slot in blocking,
                              tolerance=prompts.tolerance(self._dtype(state)), **common)
        return _Episode(KERNEL, f"{slot}/{name}", [{"role": "system", "content": system},
                                                  {"role": "user", "content": user}], slot, name,
                        self._timing_request(state, slot, shapes))

    def _timing_request(self, state: SearchState, slot: str, shapes) -> TimingRequest | None:
        """The variant a passed answer is timed against: the one the best engine runs for `slot`
        (on a CPU the torch one, unless it is a model's CPU variant), at the most called shapes."""
        timed = tuple(timed_shapes(shapes))
        if not timed:
            return None
        best = state.best
        model_variants = {**best.extra_variants, **self.variants}
        current = best.plan.slots.get(slot, "torch")
        if state.device != "cuda" and (slot, current) not in model_variants:
            current = "torch"
        dtype = {"bfloat16": "bf16"}.get(state.spec.dtype, "fp16")
        return TimingRequest(current, render_slot_module(slot, current, best.plan.params, model_variants), timed, dtype)

    def _dtype(self, state: SearchState) -> str:
        return state.spec.dtype if state.device == "cuda" else "float32"

    def _check(self, episode: _Episode, text: str, state: SearchState) -> Verdict:
        """A kernel episode's answer may also be a plan change (the prompt offers it)."""
        if episode.kind == PLAN:
            return check_plan_answer(text, state, self.variants)
        self.unit_checks += 1
        seed = (self.seed * SEED_STRIDE + self.unit_checks) % 2**31
        # Never past the run's end: an answer that loops at import held a run of --budget 120 for the
        # whole 300 s unit-check timeout (helper-35, thirty-sixth session).
        timeout = max(MIN_UNIT_CHECK_S, min(self.settings.unit_check_timeout, self._deadline - time.monotonic()))
        verdict = check_kernel_answer(text, episode.slot, episode.variant, SLOT_FUNCTIONS[episode.slot],
                                      state.device, self.seen, timeout, seed, episode.timing)
        verdict = self.tape(verdict)
        if verdict.verdict == NO_CODE and '"plan"' in text:
            return check_plan_answer(text, state, self.variants)
        return verdict

    def _repair(self, episode: _Episode, verdict: Verdict, r: int, rounds: int) -> str:
        functions = [f"{fn}__{episode.variant}" for fn in SLOT_FUNCTIONS[episode.slot]] if episode.slot else []
        return prompts.render("repair", verdict=verdict.verdict, detail=cut(verdict.detail, FEEDBACK_CHARS), round=r,
                              rounds=rounds, kind=episode.kind, functions=functions)

    def _refine(self, episode: _Episode, verdict: Verdict, refinement: int) -> str:
        functions = [f"{fn}__{episode.variant}" for fn in SLOT_FUNCTIONS[episode.slot]]
        current = episode.timing.current_name
        return prompts.render("refine", variant=episode.variant, detail=cut(verdict.detail, FEEDBACK_CHARS),
                              ratio=verdict.ratio(), current=current, lines=prompts.timing_lines(verdict.timings, current),
                              refinement=refinement, refinements=self.settings.refine_rounds, functions=functions)

    def _candidate(self, episode: _Episode, verdict: Verdict, state: SearchState) -> Candidate | None:
        """The engine to judge: the best plan with the answer's variant (or the proposed plan),
        carrying the in-memory variants it uses. None if exactly that was judged already."""
        best = state.best
        known = {**best.extra_variants, **self.variants}
        if verdict.plan is not None:
            plan, note = verdict.plan, f"model-proposed plan change: {_first_line(verdict.detail, 120)}"
        else:
            known[(episode.slot, episode.variant)] = verdict.template
            plan = Plan(best.plan.engine, {**best.plan.slots, episode.slot: episode.variant}, best.plan.params)
            note = f"{episode.slot}: model-written variant {episode.variant}"
        extra = {(s, v): known[(s, v)] for s, v in plan.slots.items() if (s, v) in known}
        candidate = Candidate(plan, origin=self.origin, note=note, extra_variants=extra)
        return None if state.tried(candidate) else candidate
