"""Prometheus metrics (prometheus_client) for the sidecar: counters fed by ledger transitions, and
gauges read at each scrape (sample states, the spool, the connected trainers' own figures)."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from connector.contract.rest import TrainerInfo
from server.ledger import Ledger, State


class SidecarMetrics:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        r = self.registry = CollectorRegistry()
        self.transitions = Counter("hsstream_samples_total", "Samples entering a state", ["state"], registry=r)
        self.tokens = Counter("hsstream_tokens_consumed_total", "Tokens acknowledged by trainers", registry=r)
        self.request_latency = Histogram(
            "hsstream_vllm_request_seconds", "vLLM /v1/completions latency", registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )  # fmt: skip
        self.states = Gauge("hsstream_samples_in_state", "Samples per state now", ["state"], registry=r)
        self.reserved = Gauge("hsstream_spool_reserved_bytes", "Spool bytes reserved (files + in flight)", registry=r)
        self.tmpfs_used = Gauge("hsstream_spool_fs_used_bytes", "Used bytes of the spool's filesystem", registry=r)
        # Settling a sample takes its lease token: a key without it was never delivered to the sender
        # (or is a copy's whose lease was replaced since). Anything but ~0 is worth a look.
        self.unheld = Counter("hsstream_unheld_settlements_total", "Keys of trainer ACK / RECEIVED / FAIL messages "
                              "ignored for want of their lease token", ["kind"], registry=r)  # fmt: skip
        self.consumed = RateMeter()
        self.trainers = TrainerGauges()
        r.register(self.trainers)
        ledger.listeners.append(self._on_transition)

    def _on_transition(self, state: State, old: State | None, n: int, tokens: int) -> None:
        self.transitions.labels(state.value).inc(n)
        if state == State.consumed:
            self.tokens.inc(tokens)
            self.consumed.add(n, tokens)

    def count_unheld(self, kind: str, n: int) -> None:
        """``DeliveryService.on_unheld``: ``kind`` acks, receiveds or fails."""
        self.unheld.labels(kind).inc(n)

    def render(self, spool: Path) -> tuple[bytes, str]:
        counts = {st.value: 0 for st in State}
        for j in list(self.ledger.jobs.values()):
            for k, v in j.counts().items():
                counts[k] += v
        for k, v in counts.items():
            self.states.labels(k).set(v)
        self.reserved.set(self.ledger.reserved_bytes)
        try:
            self.tmpfs_used.set(shutil.disk_usage(spool).used)
        except OSError:
            pass
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class TrainerGauges(Collector):
    """Each connected trainer's figures, labelled by its id (as the overview and the log name it),
    built at each scrape from the delivery thread's peers: a series exists only while its trainer
    does, so the labels are bounded by the trainers connected and one that goes (presumed dead
    after ``HSSTREAM_TRAINER_TIMEOUT_S`` of silence) takes its series with it. The wait share is
    the stream's (``Heartbeat.waited_s / alive_s``); step, loss and speed are the loop's report
    (``HiddenStateStream.report``), absent for a trainer that gives none."""

    #: (metric name, help, the figure of a TrainerInfo): one gauge family each.
    FIGURES: tuple[tuple[str, str, Callable[[TrainerInfo], float | None]], ...] = (
        ("hsstream_trainer_wait_share", "Share of the trainer's stream time spent waiting for samples, "
         "over its life (0..1)", lambda t: t.wait_share),
        ("hsstream_trainer_wait_share_recent", "The same between its last two heartbeats",
         lambda t: t.wait_share_recent),
        ("hsstream_trainer_step", "The trainer's last reported step", lambda t: t.train and t.train.step),
        ("hsstream_trainer_loss", "The trainer's last reported loss", lambda t: t.train and t.train.loss),
        ("hsstream_trainer_steps_per_second", "The trainer's reported steps per second",
         lambda t: t.train and t.train.steps_per_s),
        ("hsstream_trainer_samples_per_second", "The trainer's reported samples per second",
         lambda t: t.train and t.train.samples_per_s),
    )  # fmt: skip

    def __init__(self) -> None:
        self.source: Callable[[], list[TrainerInfo]] = list  # none until the delivery service is set

    def collect(self) -> Iterator[Metric]:
        trainers = self.source()
        yield GaugeMetricFamily("hsstream_trainers_connected", "Trainers connected to the delivery endpoint",
                                value=len(trainers))  # fmt: skip
        for name, doc, figure in self.FIGURES:
            g = GaugeMetricFamily(name, doc, labels=["trainer"])
            for t in trainers:
                if (v := figure(t)) is not None:
                    g.add_metric([t.id], float(v))
            yield g


class RateMeter:
    """Samples and tokens per second over the last ``window_s`` seconds, in one-second buckets
    (memory bounded by the window, not the rate). Prometheus users take ``rate()`` of the
    counters; this is the same figure for the REST overview and ``hsstream top``."""

    def __init__(self, window_s: int = 10, clock=time.monotonic) -> None:  # noqa: ANN001
        self.window_s = window_s
        self._clock = clock
        self._buckets: dict[int, list[int]] = {}  # whole second -> [samples, tokens]
        self._lock = threading.Lock()  # ledger transitions come from several threads

    def add(self, samples: int, tokens: int) -> None:
        now = int(self._clock())
        with self._lock:
            b = self._buckets.setdefault(now, [0, 0])
            b[0] += samples
            b[1] += tokens
            for sec in [k for k in self._buckets if k < now - self.window_s]:
                del self._buckets[sec]

    def rates(self) -> tuple[float, float]:
        """(samples/s, tokens/s) over the last full ``window_s`` seconds before this one."""
        now = int(self._clock())
        with self._lock:
            recent = [b for sec, b in self._buckets.items() if now - self.window_s <= sec < now]
        return sum(b[0] for b in recent) / self.window_s, sum(b[1] for b in recent) / self.window_s
