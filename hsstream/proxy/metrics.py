"""The proxy's Prometheus metrics (``GET /metrics``): requests, disconnects, upstream failures,
every tee outcome, and the live draft's version.

Label values are bounded: routes are the three forwarded ones, statuses vLLM's codes, tee
outcomes the fixed reasons in :data:`TEE_OUTCOMES`, versions those of the engines the proxy
has served from (at most two live at a time; older ones drop off the gauges when drained).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

#: Every way a finished request leaves the tee (``hsstream_proxy_tee_total{outcome}``).
TEE_OUTCOMES = (
    "teed",  # sent to the sidecar in a traffic job
    "held_out",  # kept for the swap's gate, never trained on
    "private",  # the private header, or the tee switched off
    "sampled_out",  # outside HSSTREAM_PROXY_SAMPLE_FRACTION
    "duplicate",  # its content hash was teed before
    "capped",  # over HSSTREAM_PROXY_MAX_PER_MINUTE
    "too_large",  # request + reply over HSSTREAM_PROXY_MAX_TEE_BYTES
    "queue_full",  # the tee's queue was full: dropped at once, the client not held
    "not_ok",  # vLLM answered other than 200, or the client or vLLM cut the reply
    "unparsable",  # the request or reply is not what samples.build takes
    "unsupported",  # a token-id or batched prompt, echo, no messages: not taken
    "sidecar_down",  # the sidecar did not answer: the batch was dropped
    "backlog",  # the sidecar already holds HSSTREAM_PROXY_MAX_BACKLOG queued samples
    "refused",  # the sidecar refused the sample (too long, a template error)
)


class ProxyMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("hsstream_proxy_requests_total", "Requests answered, by route and status",
                                ["route", "status"], registry=r)  # fmt: skip
        self.disconnects = Counter("hsstream_proxy_client_disconnects_total",
                                   "Clients that left before their reply ended (the vLLM request aborted)",
                                   ["route"], registry=r)  # fmt: skip
        self.upstream_errors = Counter("hsstream_proxy_upstream_errors_total",
                                       "vLLM unreachable (connect), silent (timeout) or cutting a reply (cut)",
                                       ["kind"], registry=r)  # fmt: skip
        self.tee = Counter("hsstream_proxy_tee_total", "Finished requests by what the tee did with them",
                           ["outcome"], registry=r)  # fmt: skip
        for o in TEE_OUTCOMES:
            self.tee.labels(o)
        self.tee_queue = Gauge("hsstream_proxy_tee_queue", "Requests waiting for the tee's thread", registry=r)
        self.draft = Gauge("hsstream_proxy_draft_info", "The draft version each engine serves (1: live, 0: draining)",
                           ["version", "upstream"], registry=r)  # fmt: skip
        self.in_flight = Gauge("hsstream_proxy_in_flight", "Requests in flight, by the draft version serving them",
                               ["version"], registry=r)  # fmt: skip
        self.swaps = Counter("hsstream_proxy_swaps_total", "Draft swaps by result (done, refused by the gate, failed)",
                             ["result"], registry=r)  # fmt: skip
        self.swap_seconds = Gauge("hsstream_proxy_last_swap_seconds", "Wall time of the last swap", registry=r)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
