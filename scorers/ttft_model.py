"""An online model of one pool's time to first token, learned from the gateway's own view.

TTFT on pod p is modelled as the pod's speed factor k_p times a cost shape shared by the
pool, linear in four features of the moment a request is sent:

    ttft ~= k_p * (c0                          fixed cost (scheduling, first step, network)
          + c1 * tokens                 uncached prompt tokens to compute: the queue ahead
                                        of the request plus its own (weights, per token)
          + c2 * pairs                  causal attention pairs of that work: n new tokens
                                        after `cached` ones attend to n * (cached + n / 2)
          + c3 * running)               decode batch sharing the prefill steps

`tokens` and `pairs` are in thousands and millions so one prior scale suits every pod.
The coefficients are fitted by recursive least squares with a forgetting factor (recent
samples weigh more), projected onto c >= 0 after each update (no cost term can be
negative), with residuals clipped at a multiple of their running scale (one preempted or
paused request must not drag the fit) and the covariance kept within its prior (the state
stays bounded even when the features do not vary). The shape is fitted on every pod's
answers, each divided by its pod's factor: one pod's answers alone often cannot separate
the terms (a pod serving mostly cache hits sees nearly the same features every time, and
a per-pod fit then trades the per-token cost for the fixed one and prices a cold prompt
on that pod far too cheaply). k_p is a running mean of log(measured / predicted) per
pod, so a slower device or a pod that slows down is followed within a few answers, and a
pod not heard from yet runs like the pods that were.

Pure: no clock, no I/O; time arrives as arguments.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..framework.scheduling import PrefillProgressView

TOKEN_UNIT = 1e3  # features in thousands of tokens ...
PAIR_UNIT = 1e6  # ... and millions of attention pairs
N_FEATURES = 4
# The spread of one TTFT around its prediction, relative to it (batching, chunk boundaries,
# scrape timing): it sets how far one sample moves the fit against the prior.
RELATIVE_NOISE = 0.2


def attention_pairs(new_tokens: float, cached_tokens: float) -> float:
    """Causal (query, key) pairs when `new_tokens` follow `cached_tokens` in prefill."""
    return new_tokens * (cached_tokens + 0.5 * new_tokens)


def features(tokens: float, pairs: float, running: float) -> list[float]:
    return [1.0, tokens / TOKEN_UNIT, pairs / PAIR_UNIT, running]


@dataclass(frozen=True, slots=True)
class Prior:
    """Starting coefficients (seconds per feature unit) and how far one sample may move
    them (standard deviations, same units)."""

    coef: tuple[float, float, float, float]
    sd: tuple[float, float, float, float]

    @classmethod
    def from_rates(
        cls,
        overhead_s: float,
        prefill_tokens_per_s: float,
        attention_s_per_pair: float,
        running_step_s: float,
    ) -> Prior:
        coef = (
            overhead_s,
            TOKEN_UNIT / prefill_tokens_per_s,
            attention_s_per_pair * PAIR_UNIT,
            running_step_s,
        )
        # Each prior is uncertain to the scale of a plausible value of its term: an
        # order of magnitude around a mid-range GPU (10k tokens/s prefill, 1e-9 s per
        # attention pair, 1 ms per running request per step), so a handful of samples
        # decide the fit and the prior only fills in what they cannot tell apart.
        sd = (
            max(overhead_s, 0.05),
            max(coef[1], 0.1),
            max(coef[2], 1e-2),
            max(running_step_s, 1e-3),
        )
        return cls(coef, sd)


Vector = list[float]
Matrix = list[list[float]]


def _diagonal(values: Vector) -> Matrix:
    return [[v if i == j else 0.0 for j in range(N_FEATURES)] for i, v in enumerate(values)]


@dataclass(slots=True)
class LinearTTFT:
    """Non-negative recursive least squares with forgetting on the four features.

    Plain Python on 4-vectors: one update per answered request, no array library in the
    gateway's start-up path."""

    coef: Vector
    cov: Matrix
    cov_limit: Vector  # the prior variances: never exceeded unless a coefficient is larger
    forgetting: float
    samples: int = 0
    residual_scale: float = 0.0  # running mean |relative residual|
    bias: float = 0.0  # running mean relative residual, signed
    # `coef` as a tuple for the scoring loop.
    c: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)

    @classmethod
    def from_prior(cls, prior: Prior, forgetting: float) -> LinearTTFT:
        var = [sd * sd for sd in prior.sd]
        model = cls(list(prior.coef), _diagonal(var), var, forgetting)
        model._sync()
        return model

    def copy(self) -> LinearTTFT:
        """The same coefficients with the prior's uncertainty: a start for another pod,
        which may well differ from the pool it is compared with."""
        return LinearTTFT(
            list(self.coef),
            _diagonal(self._variance_limit()),
            self.cov_limit,
            self.forgetting,
            0,
            self.residual_scale,
            0.0,
            self.c,
        )

    def _variance_limit(self) -> Vector:
        """Most uncertainty allowed per coefficient: the prior's, or its own size when
        larger, so a pod far from the prior can still move by its own scale."""
        return [max(lim, c * c) for lim, c in zip(self.cov_limit, self.coef, strict=True)]

    def _sync(self) -> None:
        c = self.coef
        self.c = (c[0], c[1], c[2], c[3])

    def predict(self, tokens: float, pairs: float, running: float) -> float:
        c0, c1, c2, c3 = self.c
        return c0 + c1 * tokens / TOKEN_UNIT + c2 * pairs / PAIR_UNIT + c3 * running

    def observe(self, ttft_s: float, tokens: float, pairs: float, running: float) -> None:
        x = features(tokens, pairs, running)
        predicted = sum(c * v for c, v in zip(self.coef, x, strict=True))
        # Relative errors: a 30 s TTFT off by 1 s and a 30 ms one off by 1 ms weigh the
        # same, so long prompts do not drown out the short ones.
        weight = 1.0 / (RELATIVE_NOISE * max(predicted, 1e-3))
        x = [v * weight for v in x]
        residual = (ttft_s - predicted) * weight
        # Residuals beyond 4x their running scale (and beyond 100%) are clipped: a real
        # change still moves the fit within a few samples, one outlier cannot flip it.
        if self.samples >= 4:
            bound = max(4.0 * self.residual_scale, 1.0 / RELATIVE_NOISE)
            residual = min(bound, max(-bound, residual))
        # A run of errors of one sign means the pod changed (slower, faster, a different
        # model): forget the old fit's confidence so the next samples decide.
        self.bias += 0.2 * (residual - self.bias)
        if self.samples >= 3 and abs(self.bias) > 0.25 / RELATIVE_NOISE:
            self.cov = _diagonal(self._variance_limit())
            self.bias = 0.0
        lam = self.forgetting
        n = N_FEATURES
        cov = self.cov
        px = [sum(cov[i][k] * x[k] for k in range(n)) for i in range(n)]
        denom = lam + sum(x[i] * px[i] for i in range(n))
        gain = [v / denom for v in px]
        self.coef = [max(0.0, c + g * residual) for c, g in zip(self.coef, gain, strict=True)]
        new = [[(cov[i][j] - gain[i] * px[j]) / lam for j in range(n)] for i in range(n)]
        # Forgetting inflates the covariance along directions the features never
        # explore; holding each variance within its prior keeps the state bounded.
        limit = self._variance_limit()
        scale = [(limit[i] / new[i][i]) ** 0.5 if new[i][i] > limit[i] else 1.0 for i in range(n)]
        self.cov = [
            [0.5 * (new[i][j] + new[j][i]) * scale[i] * scale[j] for j in range(n)]
            for i in range(n)
        ]
        self.samples += 1
        self.residual_scale += (abs(residual) - self.residual_scale) / min(self.samples, 32)
        self._sync()


@dataclass(slots=True)
class Inflight:
    """A request sent to a pod and not answered yet: its own prefill work."""

    tokens: float
    pairs: float
    routed_at: float
    prefill_s: float  # its own predicted prefill time
    done_at: float  # when the model expected its first token
    admitted_at: float | None = None  # the first scrape that no longer counted it waiting
    # Scrape path (no KV-event progress): when its prefill is taken to end, in admission
    # order (`PodQueue.ahead`).
    drained_at: float | None = None
    # Another picker's request (shared pool state): heard of after it was sent, perhaps
    # answered already, so one sent after the pod's last scrape is taken to drain over its
    # predicted prefill rather than to wait in full.
    peer: bool = False

    def share_before_first_token(self, now: float) -> float:
        """Share of its prefill still ahead, taken to drain over its predicted prefill
        and end at its predicted first token."""
        left = self.done_at - now
        if left <= 0:
            return 0.0
        return 1.0 if left >= self.prefill_s else left / self.prefill_s

    def share_since_admitted(self, scraped_at: float, now: float) -> float:
        """Share of its predicted prefill still ahead, taken to start at the first scrape
        that no longer counted it waiting (perhaps part-way through a long chunked
        prefill by then)."""
        if self.admitted_at is None:
            self.admitted_at = scraped_at
        left = self.admitted_at + self.prefill_s - now
        return left / self.prefill_s if left > 0 else 0.0


@dataclass(slots=True)
class PodQueue:
    """The requests this gateway sent a pod and has not seen answered, in sending order."""

    items: dict[str, Inflight] = field(default_factory=dict)
    # When the prefill of the last request admitted (scrape path) is taken to end.
    drained_until: float = 0.0

    def remove(self, request_id: str, answered_at: float | None = None) -> Inflight | None:
        """Takes a request off the queue; at its first token (`answered_at`) its prefill
        is over, so the admitted prefill behind it is taken to end that much sooner too."""
        item = self.items.pop(request_id, None)
        if item is not None and answered_at is not None and item.drained_at is not None:
            early = item.drained_at - answered_at
            if early > 0:
                self.drained_until = max(answered_at, self.drained_until - early)
        return item

    def ahead(
        self,
        now: float,
        waiting: int | None,
        scraped_at: float,
        progress: PrefillProgressView | None = None,
        lag_s: float = 0.0,
    ) -> tuple[float, float, int, int]:
        """(tokens, attention pairs, requests) of prefill still ahead of a new request, and
        how many of the scraped waiting requests were not this gateway's.

        With `progress` (the pod's KV events have confirmed the prefill of requests sent
        to it), each request's prefill is what its events show: the share of its uncached
        blocks not stored yet, nothing once they all are. vLLM admits in arrival order, so
        a request sent before one that has started has been admitted too (with no blocks
        of its own to store when nothing shows). One that shows nothing is placed by the
        scrape as below: waiting when sent after it or among its waiting count, else
        admitted and draining over its predicted prefill. The events are `lag_s` old
        (`PrefillProgressView.lag_s`): what they and the scrape place is aged by that much.

        Otherwise, with a scrape, the pod says how many requests were waiting then: they
        are the newest of this gateway's requests sent before it, and every request sent
        since is waiting too. Without one (`waiting` None), each request is taken to
        drain over its own predicted prefill, ending at its predicted first token.
        """
        if progress is not None:
            return self._ahead_by_progress(now, waiting, scraped_at, progress, lag_s)
        tokens = pairs = 0.0
        count = 0
        if waiting is None:
            # Newest first: predicted first tokens come in sending order, so the first
            # one already past ends the search.
            for item in reversed(self.items.values()):
                frac = item.share_before_first_token(now)
                if frac <= 0:
                    break
                tokens += frac * item.tokens
                pairs += frac * item.pairs
                count += 1
            return tokens, pairs, count, 0
        self._admit(waiting, scraped_at)
        for item in reversed(self.items.values()):
            if item.routed_at <= scraped_at:
                if waiting > 0:
                    waiting -= 1
                else:
                    # Admitted by the time of the scrape. Prefill runs in admission
                    # order, so older requests' ends are no later: the first one done
                    # ends the search. `_admit` has placed every admitted request.
                    drained_at = item.drained_at if item.drained_at is not None else now
                    left = drained_at - now
                    if left <= 0:
                        break
                    frac = left / item.prefill_s if left < item.prefill_s else 1.0
                    tokens += frac * item.tokens
                    pairs += frac * item.pairs
                    continue
            elif item.peer:
                frac = item.share_before_first_token(now)
                if frac > 0:
                    tokens += frac * item.tokens
                    pairs += frac * item.pairs
                    count += 1
                continue
            tokens += item.tokens
            pairs += item.pairs
            count += 1
        return tokens, pairs, count, waiting

    def _admit(self, waiting: int, scraped_at: float) -> None:
        """Places the requests the scrape saw admitted for the first time (those sent
        before it, past the newest `waiting`) in the pod's prefill order: vLLM prefills
        admitted requests in arrival order (a long prompt's chunks first, the requests
        behind it after), so each is taken to start when the one before it ends, or at
        this scrape if later, and to take its predicted prefill. The scrape is the latest
        it can have started, and the start taken: the pod may have been busy with work
        this gateway did not send (other pickers' requests) since it was sent."""
        admitting: list[Inflight] = []
        for item in reversed(self.items.values()):
            if item.routed_at > scraped_at:
                continue
            if waiting > 0:
                waiting -= 1
                continue
            if item.drained_at is not None:
                break  # placed at an earlier scrape, and so is every request before it
            admitting.append(item)
        end = self.drained_until
        for item in reversed(admitting):
            end = max(end, scraped_at) + item.prefill_s
            item.drained_at = end
        self.drained_until = end

    def _ahead_by_progress(
        self,
        now: float,
        waiting: int | None,
        scraped_at: float,
        progress: PrefillProgressView,
        lag_s: float,
    ) -> tuple[float, float, int, int]:
        """`ahead` from the pod's KV events: the requests they show started are admitted
        (not queued) with their uncached blocks not stored yet still to compute.

        The events show the pod as it was `lag_s` ago; since then it has gone on with its
        prefill, in admission order, at each request's predicted prefill time. So the
        requests the events and the scrape place (not those placed by their predicted
        drain, which runs to `now` already) are aged by that much: without it a pod whose
        events arrive seconds late looks seconds of work busier than it is, and the
        learner, fed that phantom queue, unlearns the per-token cost. A lag longer than the
        queue (a pod whose clock runs behind the gateway's) leaves each request drained
        from its sending at its predicted prefill: the queue the predictions alone give."""
        tokens = pairs = 0.0
        count = 0
        started_later = False  # a request sent after this one has begun its prefill
        # With a lag: (request, share left, whether the signals place it, whether it counts
        # as queued) of every request still ahead, newest first, aged below.
        placed: list[tuple[Inflight, float, bool, bool]] | None = [] if lag_s > 0 else None
        for request_id, item in reversed(self.items.items()):
            seen = progress.computed(request_id)
            before_scrape = waiting is not None and item.routed_at <= scraped_at
            done, watched = seen if seen is not None else (0, 0)
            by_signals = queued = False
            if done > 0:
                if before_scrape and waiting:
                    waiting -= 1  # perhaps still waiting at the scrape, admitted since
                started_later = True
                if done >= watched:
                    continue
                frac = 1.0 - done / watched
                by_signals = True
            elif started_later and watched > 0:
                continue
            elif waiting is None:
                frac = item.share_before_first_token(now)
                if frac <= 0:
                    continue
                queued = True
            elif before_scrape and not waiting:
                # Admitted by the scrape, yet nothing stored: admitted just now (its events
                # not in yet), or nothing of its own to store (its blocks were cached, or
                # fewer than a block).
                frac = item.share_since_admitted(scraped_at, now)
                if frac <= 0:
                    continue
            elif item.peer and not before_scrape:
                frac = item.share_before_first_token(now)
                if frac <= 0:
                    continue
                queued = True
            else:
                if before_scrape:
                    waiting -= 1
                frac = 1.0
                queued = by_signals = True
            count += queued
            if placed is not None:
                placed.append((item, frac, by_signals, queued))
                continue
            tokens += frac * item.tokens
            pairs += frac * item.pairs
        if placed:
            # The pod's prefill over the lag, oldest request first. A request placed by
            # its predicted drain is taken to be where that prediction puts it now: while
            # it has work left, the pod has not got to the requests behind it.
            t = now - lag_s
            for item, frac, by_signals, queued in reversed(placed):
                if t < now:
                    if not by_signals:
                        t = now
                    else:
                        end = max(t, item.routed_at) + frac * item.prefill_s
                        if end <= now:
                            t = end
                            count -= queued
                            continue
                        frac = min(frac, (end - now) / item.prefill_s)
                        t = now
                tokens += frac * item.tokens
                pairs += frac * item.pairs
        return tokens, pairs, count, waiting or 0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What was ahead of a request on its pod when it was sent: the learner's features."""

    tokens_ahead: float
    pairs_ahead: float
    running: float


@dataclass(slots=True)
class PodSpeed:
    """How much slower (> 1) or faster (< 1) one pod answers than the pool's cost shape
    predicts: a running mean of log(measured / predicted), and how noisy that mean is."""

    log_scale: float = 0.0
    samples: int = 0
    scale: float = 1.0
    # Running mean of log(measured / predicted)^2: the spread of single answers.
    log_var: float = 0.0

    def mean_variance(self) -> float:
        """Variance of `log_scale` as an estimate: the answers' spread over the number
        of answers the running mean effectively averages (n at first, then
        (2 - SPEED_RATE) / SPEED_RATE, about 24)."""
        if self.samples == 0:
            return math.inf
        return self.log_var * max(SPEED_RATE / (2.0 - SPEED_RATE), 1.0 / self.samples)

    def credible_log_scale(self, pool_log_scale: float) -> float:
        """The factor's distance from the pool's, shrunk by its own noise (positive-part
        James-Stein): a difference within one standard error is taken as none. Identical
        pods then rank alike instead of by whose recent answers happened to queue less,
        which sent every new prefix to the luckiest of them; a pod that is really slower
        (a difference well beyond its noise) keeps nearly all of it."""
        gap = self.log_scale - pool_log_scale
        noise = self.mean_variance()
        if gap * gap <= noise:
            return pool_log_scale
        return pool_log_scale + gap * (1.0 - noise / (gap * gap))


# How far one answer moves a pod's speed factor once it has a few, and the largest ratio an
# answer counts with after that: a paused or preempted request moves the factor by at most
# 6%, a pod that became 2x slower is priced at 1.7x within about fifteen answers (sooner
# when the shape moves too), and the first answers are averaged, so a pod of another kind
# is placed at once. A faster rate follows pods sooner but lets queueing noise in the
# answers make identical pods look different (measured in the policy grid, benchmarks/RESULTS.md).
SPEED_RATE = 0.08
SPEED_SETTLED = 4
SPEED_RATIO_LIMIT = 2.0


class TTFTLearner:
    """One cost shape for the pool, one speed factor per pod, with bounded state.

    The pods of one pool serve one model, normally on one kind of accelerator, so how TTFT
    grows with queued work, prompt length and attention is shared: the pool-wide model
    learns it from every pod's answers, which vary far more than one pod's (a pod that
    mostly serves cache hits sees nearly constant features and could not tell a fixed cost
    from a per-token one on its own). What differs between pods — a slower device, a noisy
    neighbour, throttling — is a factor on the whole prediction, learned per pod."""

    def __init__(self, prior: Prior, forgetting: float = 0.97, max_pods: int = 4096) -> None:
        self.prior = prior
        self.forgetting = forgetting
        self.max_pods = max_pods
        self.pool = LinearTTFT.from_prior(prior, forgetting)
        self.pods: dict[str, PodSpeed] = {}
        self._log_scale_sum = 0.0
        # The factor most pods share (median of the log factors), updated per answer.
        self.center_log_scale = 0.0

    def typical_scale(self) -> float:
        """A pod not heard from yet is taken to run like the pods that were: the pool's
        shape is learned in their units (geometric mean of their factors)."""
        return math.exp(self._log_scale_sum / len(self.pods)) if self.pods else 1.0

    def scale(self, address: str) -> float:
        """The pod's factor as predictions use it: its learned factor, less what its
        answers' noise accounts for."""
        speed = self.pods.get(address)
        if speed is None:
            return self.typical_scale()
        return math.exp(speed.credible_log_scale(self.center_log_scale))

    def predict(self, address: str, tokens: float, pairs: float, running: float) -> float:
        return self.scale(address) * self.pool.predict(tokens, pairs, running)

    def observe(
        self,
        address: str,
        ttft_s: float,
        prompt_tokens: int,
        cached_tokens: int,
        ahead: Snapshot,
    ) -> None:
        """One answered request: its measured TTFT, its prompt and cached tokens, and what
        was ahead of it on the pod when it was sent."""
        if ttft_s <= 0 or prompt_tokens <= 0:
            return
        cached = min(max(0, cached_tokens), prompt_tokens - 1)
        own = float(prompt_tokens - cached)
        tokens = ahead.tokens_ahead + own
        pairs = ahead.pairs_ahead + attention_pairs(own, cached)
        speed = self.pods.get(address)
        if speed is None:
            if len(self.pods) >= self.max_pods:
                self._log_scale_sum -= self.pods.pop(next(iter(self.pods))).log_scale
            typical = self.typical_scale()
            speed = self.pods[address] = PodSpeed(math.log(typical), 0, typical)
            self._log_scale_sum += speed.log_scale
        predicted = self.pool.predict(tokens, pairs, ahead.running)
        if predicted > 0:
            before = speed.scale
            ratio = ttft_s / (before * predicted)
            # The factor is a pod's speed at the work; an answer that is mostly the fixed
            # cost (a few-token prompt, nothing ahead) says little about it, so it moves
            # the factor by its work's share and leaves the rest to the pool's shape.
            work_share = max(0.0, 1.0 - self.pool.c[0] / predicted)
            rate = max(SPEED_RATE, 1.0 / (speed.samples + 1)) * work_share
            if speed.samples >= SPEED_SETTLED:
                # An answer far off the prediction (a paused or preempted request) counts
                # as at most SPEED_RATIO_LIMIT off, for the factor and for the shape.
                ratio = min(SPEED_RATIO_LIMIT, max(1.0 / SPEED_RATIO_LIMIT, ratio))
                ttft_s = ratio * before * predicted
            log_ratio = math.log(ratio)
            step = rate * log_ratio
            spread_rate = max(SPEED_RATE, 1.0 / (speed.samples + 1))
            speed.log_var += spread_rate * (log_ratio * log_ratio - speed.log_var)
            speed.log_scale += step
            self._log_scale_sum += step
            speed.scale = math.exp(speed.log_scale)
        speed.samples += 1
        self.center_log_scale = statistics.median(p.log_scale for p in self.pods.values())
        # The pool learns the shape in the pool's own units: this pod's answer as if it
        # ran at the pool's speed.
        self.pool.observe(ttft_s / speed.scale, tokens, pairs, ahead.running)

    def forget(self, address: str) -> None:
        """The pod left the pool: its factor no longer counts toward the typical one."""
        speed = self.pods.pop(address, None)
        if speed is None:
            return
        self._log_scale_sum -= speed.log_scale
        self.center_log_scale = (
            statistics.median(p.log_scale for p in self.pods.values()) if self.pods else 0.0
        )

    def coefficients(self, address: str) -> tuple[float, float, float, float]:
        """(s, s per 1k tokens, s per 1M pairs, s per running request) for the pod."""
        k = self.scale(address)
        c0, c1, c2, c3 = self.pool.c
        return (k * c0, k * c1, k * c2, k * c3)
