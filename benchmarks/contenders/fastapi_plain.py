"""Contender: a plain FastAPI endpoint, no batching; each request runs the model alone.

The handler does the whole request in the event loop (read the body, validate it, decode,
forward, answer): on one core that is the least overhead a FastAPI endpoint can have. The
model loading, codec and answer are gpuflow's (``_digits``), as in `gpuflow serve`.

    python benchmarks/contenders/fastapi_plain.py MODEL.safetensors --port 8001
"""

from __future__ import annotations

import argparse
import json

import uvicorn
from _digits import InputError, PredictRequest, answer, load_engine, run_rows
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError


def create_app(source: str, threads: int) -> FastAPI:
    engine = load_engine(source, max_batch_size=32, threads=threads)
    app = FastAPI(title="plain FastAPI digits")

    @app.get("/readyz")
    async def readyz() -> dict[str, bool]:
        return {"ready": True}

    @app.post("/v1/predict")
    async def predict(request: Request) -> JSONResponse:
        body = await request.body()
        try:
            parsed = PredictRequest.model_validate_json(body)
            decoded = engine.codec.decode(parsed)
        except ValidationError as exc:
            return JSONResponse({"error": {"code": "invalid_request", "details": json.loads(
                exc.json(include_url=False))}}, status_code=422)
        except InputError as exc:
            return JSONResponse({"error": {"code": "invalid_input", "message": str(exc)}},
                                status_code=422)
        outputs, compute_s, rows = run_rows(engine, [decoded])
        return JSONResponse(answer(engine, parsed, outputs[0], compute_s, rows, 0.0))

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    uvicorn.run(create_app(args.model, args.threads), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
