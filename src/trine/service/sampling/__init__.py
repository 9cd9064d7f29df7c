"""Sampling: accept a request, pick a replica, run it, meter it, store the outcome for retries.

One `SampleCall` (call.py) is built per new request and goes through four stages: accept
(accept.py), route (route.py), run (run.py), record (record.py); `Sampling` (pipeline.py) wires
them for `sample`, `sample_stream` and `cancel`.

Invariants
- A request id is served once per sampling run: a retry joins the request still running or gets
  the stored outcome; nothing is metered twice. The same id with a different request (another
  fingerprint) is a 409.
- Metered tokens add up: prompt = prefill computed + cached, from the engine's usage.
- The stored outcome is protocol-neutral (`SampleOutcome`); each front end shapes it on read.
- A metered request is timed too (store `Timing`, for session traces: accepted here, prefill begun
  and done in the engine, finished), in the same transaction as its usage when it finishes.
- A sampler made from a TEMPORARY snapshot that only one replica holds in memory is served there.
- A stream its consumer closes early (a client that went away) is cancelled in the engine at once
  and metered for what it computed: its client may already hold every token but the last. So is a
  request its client cancels (`cancel`, Tinker's cancel_future).
- An inflight sampling run's requests run on its training run's inflight target, at the run's
  version or newer (inflight.py); their outcomes name each token's weights version. On a pool
  they go to replicas other than the one training the run, so sampling overlaps training there.
- A finished request whose outcome a full disk keeps from the store still answers its caller (and
  a retry, from memory); the outcome and its usage are stored with the next request's.
- New requests pass the `WorkGate` (gate.py). At a shutdown's deadline `cancel_all` cancels the
  requests still running, all at once and without waiting on a busy engine for longer than its
  bound, meters what each computed (once, when its engine answers), and their callers get 503
  `server_shutting_down` (the actor plane breaks off a response whose 200 already began).
"""

from .call import SampleCall
from .pipeline import Sampling

__all__ = ["SampleCall", "Sampling"]
