"""An image sent to ``/v1/predict`` as the body itself (``Content-Type: image/jpeg``) or as a
multipart upload, turned into the request a JSON body with ``"image"`` would be.

The declared type must be one the server reads (JPEG, PNG, WebP) and agree with the bytes'
signature; otherwise 415 names both. Options (``top_k``, ``timeout_ms``) come from the
query string.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from email.message import Message
from email.parser import BytesParser
from email.policy import HTTP

from gpuflow.serve.errors import ApiError
from gpuflow.serving import PredictRequest

SIGNATURES = {"image/jpeg": (b"\xff\xd8\xff",), "image/png": (b"\x89PNG\r\n\x1a\n",),
              "image/webp": (b"RIFF",)}
GENERIC = ("application/octet-stream", "")  # an upload without a type: its signature says
OPTIONS = ("top_k", "timeout_ms")


def _unsupported(declared: str, reason: str) -> ApiError:
    return ApiError(415, f"Content-Type {declared!r} {reason}; send a JPEG, PNG or WebP "
                    f"image as {', '.join(SIGNATURES)}, a multipart/form-data upload, or a "
                    "JSON body.", "unsupported_media_type")


def sniffed(data: bytes) -> str | None:
    """The image type the bytes' signature shows, if one the server reads."""
    for kind, signatures in SIGNATURES.items():
        if any(data.startswith(s) for s in signatures) and (kind != "image/webp"
                                                           or data[8:12] == b"WEBP"):
            return kind
    return None


def _checked(declared: str, data: bytes) -> bytes:
    if declared not in SIGNATURES and declared not in GENERIC:
        raise _unsupported(declared, "is not an image type this server reads")
    found = sniffed(data)
    if declared in SIGNATURES and found is not None and found != declared:
        raise _unsupported(declared, f"does not match the bytes sent, which are {found}")
    return data


def _multipart_image(content_type: str, body: bytes) -> bytes:
    message = BytesParser(policy=HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    parts: list[Message] = list(message.iter_parts()) if message.is_multipart() else []
    for part in parts:
        if part.get_filename() or part.get_content_type().startswith("image/"):
            payload = part.get_payload(decode=True)
            declared = part.get_content_type() if part.get("Content-Type") else ""
            return _checked(declared, payload if isinstance(payload, bytes) else b"")
    raise ApiError(422, "The multipart upload holds no file part; send the image as a form "
                   "field with a filename (curl -F image=@photo.jpg).", "invalid_input")


def image_upload(content_type: str | None, body: bytes,
                 query: Mapping[str, str]) -> PredictRequest | None:
    """The request an image upload stands for; None for any other body (JSON)."""
    declared = (content_type or "").split(";")[0].strip().lower()
    if declared.startswith("multipart/"):
        data = _multipart_image(content_type or "", body)
    elif declared.startswith("image/"):
        data = _checked(declared, body)
    else:
        return None
    options = {name: query[name] for name in OPTIONS if name in query}
    return PredictRequest.model_validate(
        {"image": base64.b64encode(data).decode(), **options})
