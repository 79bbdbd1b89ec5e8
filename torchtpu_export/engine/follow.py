"""Several processes, one program (JAX's multi-controller runtime): process 0's engine takes the requests
and broadcasts each step's events (new requests, cancels, stop) at its start; the others' engines run
the same steps (``follow``), so that all call the same programs in the same order. The tokens a step
samples are replicated, so every process sees them.

:class:`Following` is a part of :class:`~.scheduler.Engine` (a mixin): it works on the engine's own
queues and slots."""
from __future__ import annotations

import dataclasses
import json

import numpy as np

from ..errors import InputError
from .request import Request, SamplingParams


class Following:
    """The start of each step (``_sync``, one process or several) and ``follow`` (processes 1..)."""

    def _sync(self) -> bool:
        """The start of a step: requests submitted and cancelled since the last one become the scheduler's,
        a snapshot that nothing changes while the step runs. Under several processes process 0 takes them
        and broadcasts them, so that every process schedules the same steps and calls its programs in the
        same order (the multi-controller contract); the tokens a step makes are replicated, so every
        process then sees the same. Returns False once the engine stops (process 0 says so)."""
        with self._cv:
            new, stopping = list(self._inbox), self._stopping
            self._inbox.clear()
        live = {r.id: r for r in self._waiting} | {s.request.id: s.request for s in self._slots if s.request}
        cancelled = [i for i, r in live.items() if r.cancelled and not r.dropped]
        if self.processes > 1:
            new, cancelled, stopping = self._broadcast(new, cancelled, stopping)
        for i in cancelled:
            live[i].dropped = True
        self._waiting.extend(new)
        self._halted = self._halted or stopping
        return not self._halted

    def _broadcast(self, new: list, cancelled: list, stopping: bool):
        """Process 0's step events to every process: their length first (one small collective per step,
        all an idle step costs), then the events themselves when there are any."""
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

    def follow(self) -> None:
        """Under several processes, on every process but 0: runs the steps process 0 schedules (the same
        programs in the same order, over this process's devices) until process 0's engine stops."""
        if self.lead:
            raise InputError("follow() is for the engines of processes 1.. of a multi-process program; this one "
                             "takes the requests itself", hint="submit() and step() or start() here")
        while not self._halted:
            self._guarded_step()
        self._reset(InputError("the engine stopped"))
