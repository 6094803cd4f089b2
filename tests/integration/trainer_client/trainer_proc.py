"""A trainer process for crash tests: consumes with HiddenStateStream, logs every key it
yields and every ack it sends (one JSON line each, flushed), optionally stops consuming after
N samples and waits to be killed."""

from __future__ import annotations

import argparse
import json
import sys
import time

from trainer_client import HiddenStateStream


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--spool", required=True)
    ap.add_argument("--jobs", nargs="*")
    ap.add_argument("--log", required=True)
    ap.add_argument("--hang-after", type=int, default=0, help="stop consuming after N samples")
    ap.add_argument("--sleep-per-sample", type=float, default=0.0)
    ap.add_argument("--hold-views", type=int, default=0,
                    help="keep the first N samples' hidden states as yielded (views of an arena slot) to the end, "
                         "and log whether their values changed meanwhile")  # fmt: skip
    ap.add_argument("--transport", default=None, help="spool | zmq | mooncake (default: by endpoint)")
    ap.add_argument("--server-key", default=None, help="tcp://: the sidecar's public CURVE key file")
    ap.add_argument("--client-cert", default=None, help="tcp://: this trainer's .key_secret file")
    a = ap.parse_args()
    out = open(a.log, "a", buffering=1)  # noqa: SIM115
    n = 0
    held: list = []  # (as yielded, a private copy)
    with HiddenStateStream(a.endpoint, jobs=a.jobs or None, spool_dir=a.spool, ack="manual", timeout_s=300,
                           heartbeat_s=0.5, transport=a.transport, curve_server_key=a.server_key,
                           curve_client_cert=a.client_cert) as s:  # fmt: skip
        for smp in s:
            n += 1
            out.write(json.dumps({"used": str(smp.key), "tokens": int(smp.token_ids.shape[0]),
                                  "label": smp.label, "ids": smp.token_ids.tolist(),
                                  "hs": [float(smp.hidden_states.float().sum()), list(smp.hidden_states.shape)]})
                      + "\n")  # fmt: skip
            if len(held) < a.hold_views:
                held.append((smp.hidden_states, smp.hidden_states.clone()))
            if a.hang_after and n >= a.hang_after:
                out.write(json.dumps({"hang": n}) + "\n")
                while True:  # used but never acked: must be produced again after we die
                    time.sleep(1)
            s.ack_through(smp.key)
            out.write(json.dumps({"acked": str(smp.key)}) + "\n")
            if a.sleep_per_sample:
                time.sleep(a.sleep_per_sample)
        stats = dict(s.stats)
    if held:
        out.write(json.dumps({"held_views_unchanged": all(bool((v == c).all()) for v, c in held)}) + "\n")
    out.write(json.dumps({"end": n, "stats": stats}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
