"""Several processes, one program (JAX's multi-controller runtime): process 0's engine takes the requests
and broadcasts each step's events (new requests, cancels, stop) at its start; the others' engines run
the same steps (``follow``), so that all call the same programs in the same order. The tokens a step
samples are replicated, so every process sees them.

:class:`StepEvents` is the engine's collaborator for this: the engine (:mod:`.scheduler`) gathers a step's
events from its own queues and slots, and exchanges them through it."""
from __future__ import annotations

import dataclasses
import json

import numpy as np

from .request import Request, SamplingParams


class StepEvents:
    """Each step's events (requests submitted, requests cancelled, stop) as every process sees them: process
    0's (``lead``), broadcast to the others at the start of the step, so that all schedule the same steps.
    One per engine of a program sharded over several processes."""

    def __init__(self, lead: bool):
        self.lead = lead

    def exchange(self, new: list, cancelled: list, stopping: bool):
        """Process 0's step events to every process: their length first (one small collective per step,
        all an idle step costs), then the events themselves when there are any. Returns ``(new requests,
        cancelled ids, stopping)`` as process 0 has them (on the others, copies of its requests)."""
        from jax.experimental import multihost_utils
        msg = b""
        if self.lead and (new or cancelled or stopping):
            msg = json.dumps({"new": [[r.id, r.prompt, dataclasses.asdict(r.params)] for r in new],
                              "cancelled": cancelled, "stop": stopping}).encode()
        n = int(multihost_utils.broadcast_one_to_all(np.array([len(msg)], np.int32))[0])
        if not n:
            return [], [], False
        buf = np.zeros(max(256, 1 << (n - 1).bit_length()), np.uint8)  # a few shapes: a few compilations
        buf[:len(msg)] = np.frombuffer(msg, np.uint8)
        if self.lead:
            multihost_utils.broadcast_one_to_all(buf)
            return new, cancelled, stopping
        event = json.loads(multihost_utils.broadcast_one_to_all(buf)[:n].tobytes())
        requests = []
        for rid, prompt, params in event["new"]:  # this process's copies: nobody reads their tokens
            r = Request(prompt, SamplingParams.from_json(params))
            r.id = rid
            requests.append(r)
        return requests, event["cancelled"], event["stop"]
