"""``torchtpu-export serve MODEL``: a model server on KServe's Python model server.

    torchtpu-export serve model.tpu [--name NAME] [--host 127.0.0.1] [--port 8080]

Every artifact (``.tpu``, ``.tflite``) is served with the Open Inference Protocol v2, the REST protocol
KServe and Triton speak, implemented by KServe itself: ``/v2/models/{name}/infer``, ``/v2/models/{name}``
(metadata), ``/v2/models/{name}/ready``, ``/v2/health/live`` and ``/v2/health/ready``. An LLM (a ``.tpu``
from ``tte.export_llm``) is run by the continuous-batching engine (:mod:`torchtpu_export.engine`) and also
gets OpenAI's ``/v1/completions``, ``/v1/chat/completions`` (streamed as server-sent events with
``"stream": true``) and ``/v1/models``; its v2 endpoint takes ``input_ids`` (INT32, ``[n]``) and optional
``max_new_tokens`` (INT32, ``[1]``) and gives ``output_ids``.

KServe's own OpenAI layer is built on vLLM's request types (it imports vLLM, a GPU engine); the OpenAI
routes here are this package's, mounted on the same FastAPI application KServe serves. A bad request
gets a 4xx with one message and never touches other requests; a client that goes away mid-stream
frees its slot at the next engine step.

The parts: :mod:`.app` (:class:`Served`, :func:`serve`, the health routes, the command line), :mod:`.v2`
(the v2 model on KServe), :mod:`.openai` (the OpenAI routes), :mod:`.guard` (:class:`RequestGuard`, the
middleware in front), :mod:`.common` (what a request may carry) and :mod:`.distributed` (several hosts);
text work runs in :mod:`torchtpu_export.llm.textproc`'s worker processes. Importing the package imports
neither KServe nor JAX: KServe is imported when a server starts, the engine (and JAX) only when an LLM is
served.
"""
from __future__ import annotations

from . import distributed
from .app import HELP, Served, add_arguments, mount_health, run_cli, serve
from .common import Limits
from .guard import RequestGuard
from .openai import OpenAIError, OpenAIServer
from .v2 import NP_TO_V2, V2_DTYPES, import_kserve, make_v2_model, v2_shape

__all__ = ["HELP", "Limits", "NP_TO_V2", "OpenAIError", "OpenAIServer", "RequestGuard", "Served", "V2_DTYPES",
           "add_arguments", "distributed", "import_kserve", "make_v2_model", "mount_health", "run_cli", "serve",
           "v2_shape"]
