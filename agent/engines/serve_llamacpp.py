"""Run llama.cpp's own C++ HTTP server (embedded in the PyPI wheel ``xllamacpp``). Runs in the engine's venv.

The HTTP server, slots, continuous batching, SSE streaming, ``/metrics`` (``llamacpp:*``) and ``/slots``
are llama.cpp's code, running in threads of this process; Python only fills ``CommonParams`` (the
fields ``llama-server``'s flags set) and waits for SIGTERM. Flags mirror ``llama-server``'s.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

import xllamacpp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("-c", "--ctx-size", type=int, default=8192, help="total KV context, split over slots")
    ap.add_argument("-np", "--parallel", type=int, default=4, help="slots (sequences decoded together)")
    ap.add_argument("-t", "--threads", type=int, default=1, help="compute threads (see LaunchOptions)")
    ap.add_argument("--alias", default="tiny-random-llama", help="model name the API reports")
    ap.add_argument("--embeddings", action="store_true", help="serve /v1/embeddings too (mean pooling)")
    ap.add_argument(
        "-ub", "--ubatch-size", type=int, default=512, help="physical batch (longest input to embed)"
    )
    a = ap.parse_args()

    p = xllamacpp.CommonParams()
    p.model.path = a.model
    p.hostnames = [a.host]
    p.port = a.port
    p.n_ctx = a.ctx_size
    p.n_parallel = a.parallel
    p.cpuparams.n_threads = a.threads
    p.cpuparams_batch.n_threads = a.threads
    p.endpoint_metrics = True
    p.endpoint_slots = True
    p.endpoint_props = True
    p.cont_batching = True
    p.offline = True  # never reach for a model hub
    p.model_alias = {a.alias}
    p.n_ubatch = a.ubatch_size
    p.n_batch = max(p.n_batch, a.ubatch_size)
    if a.embeddings:  # an input is embedded whole, in one physical batch
        p.embedding = True
        p.pooling_type = xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_MEAN

    server = xllamacpp.Server(p)  # loads the model and starts listening
    print(f"xllamacpp {xllamacpp.__version__} listening on {server.listening_address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(3600):
        pass
    sys.stdout.flush()
    os._exit(0)  # the embedded server's threads do not survive C++ static destructors cleanly


if __name__ == "__main__":
    main()
