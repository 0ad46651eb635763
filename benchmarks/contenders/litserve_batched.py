"""Contender: LitServe with dynamic batching (default: up to 32 requests, 5 ms timeout).

LitServe runs the HTTP server (uvicorn) and the model in separate processes joined by
queues: the API process parses the JSON and queues it, the inference worker collects a
batch, decodes each request, runs them as one batch and sends each answer back. The model
loading, codec and answer are gpuflow's (``_digits``), as in `gpuflow serve`. Health:
``GET /health``.

    python benchmarks/contenders/litserve_batched.py MODEL.safetensors --port 8002
"""

from __future__ import annotations

import argparse
import socket
from typing import Any

import litserve as ls
import uvicorn
from _digits import InputError, PredictRequest, answer, load_engine, run_rows
from fastapi import HTTPException
from pydantic import ValidationError


class DigitsAPI(ls.LitAPI):
    def __init__(self, source: str, threads: int, max_batch_size: int,
                 batch_timeout: float) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout,
                         api_path="/v1/predict")
        self.source, self.threads = source, threads

    def setup(self, device: str) -> None:
        self.engine = load_engine(self.source, self.max_batch_size, self.threads)

    # Unannotated: LitServe then hands over the parsed JSON body (an annotation would
    # make FastAPI read the argument from the query string).
    def decode_request(self, request):  # type: ignore[no-untyped-def]
        try:
            parsed = PredictRequest.model_validate(request)
            return parsed, self.engine.codec.decode(parsed)
        except (ValidationError, InputError) as exc:
            raise HTTPException(422, str(exc)) from None

    def batch(self, inputs: list[Any]) -> list[Any]:
        return inputs

    def predict(self, batch: list[Any]) -> list[Any]:
        outputs, compute_s, rows = run_rows(self.engine, [decoded for _, decoded in batch])
        return [(parsed, out, compute_s, rows) for (parsed, _), out in zip(batch, outputs,
                                                                          strict=True)]

    def unbatch(self, output: list[Any]) -> list[Any]:
        return output

    def encode_response(self, output: Any) -> dict[str, Any]:
        parsed, outputs, compute_s, rows = output
        return answer(self.engine, parsed, outputs, compute_s, rows, None)


def _bind_tcp_socket(config: uvicorn.Config) -> socket.socket:
    """uvicorn's socket, marked as TCP. LitServe binds its socket itself (to share it among
    API processes) with ``Config.bind_socket``, which creates it with protocol 0; asyncio
    then does not set TCP_NODELAY on accepted connections, and every answer (headers and
    body written separately) waits ~40 ms for the client's delayed ACK. With uvloop (in
    ``uvicorn[standard]``, not installed here) that does not happen; marking the socket TCP
    gives LitServe the same asyncio + h11 stack as the other servers, without the stall."""
    sock = _original_bind_socket(config)
    return socket.socket(sock.family, sock.type, socket.IPPROTO_TCP, fileno=sock.detach())


_original_bind_socket = uvicorn.Config.bind_socket


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--port", type=int, default=8002)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--fast-queue", action="store_true",
                        help="LitServe's ZeroMQ queues instead of multiprocessing's")
    args = parser.parse_args()
    api = DigitsAPI(args.model, args.threads, args.max_batch_size, args.max_wait_ms / 1000)
    uvicorn.Config.bind_socket = _bind_tcp_socket  # type: ignore[method-assign]
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1,
                          fast_queue=args.fast_queue)
    server.run(host="127.0.0.1", port=args.port, log_level="warning", num_api_servers=1,
               generate_client_file=False)


if __name__ == "__main__":
    main()
