"""llama.cpp's `llama-server` as a generation contender: found, or built from the registry.

With no GitHub at hand, llama.cpp comes from `llama-cpp-python`'s source distribution on
PyPI, which vendors it (``vendor/llama.cpp``, a git checkout): `llama-server` is built from
it with cmake into ``.cache-llama/`` (7-20 minutes on 2 cores, once), unless
``--llama-server PATH`` or ``$LLAMA_SERVER`` names a built one. Its ``convert_hf_to_gguf.py``
turns a Hugging Face directory into a float32 GGUF file: a real model's (SmolLM2, a Llama
with a BPE tokenizer the converter knows) as it is; textlm's export with two shims, both
checked by the benchmark before it measures anything:

- the export's config names its context ``n_positions`` (as transformers does) and the
  converter reads GPT-2's older ``n_ctx``: a copy of the export gets both;
- the export's tokenizer is 256 byte tokens and no merges. The converter knows
  pre-tokenizers by the hash of one text's tokens, and knows none that yields bytes: it is
  told GPT-2's (with no merges, any pre-tokenizer yields the same byte tokens). llama.cpp
  needs a merges key, and GGUF has no empty arrays: the file gets one merge of two
  ``<|endoftext|>`` strings, which never applies (BPE symbols start as single characters).

``check_tokens`` asks the running server to tokenize the prompt, and the benchmark keeps
llama.cpp only if it gets one token a byte, as gpuflow does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import httpx
from _common import stop
from _load import Contender
from serving import free_port

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache-llama"  # git-ignored
SDIST = "llama-cpp-python"
SDIST_VERSION = "0.3.36"  # vendors llama.cpp 0c1e570
# gpuflow's tokens/s over llama.cpp's, by clients: textlm's (issue 41), SmolLM2's (issue 50).
TARGETS = {"textlm": {"1": 0.5, "8": 1.0, "32": 1.5}, "smollm2": {"1": 0.8, "8": 1.0}}
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DGGML_NATIVE=ON",
               "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"]
# Run in the converter's folder: the two shims the module docstring describes, then the
# converter itself with the arguments given.
CONVERT = """
import runpy, sys
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
set_vocab = base.TextModel._set_vocab_gpt2
def with_inert_merge(self):
    set_vocab(self)
    self.gguf_writer.add_token_merges(["<|endoftext|> <|endoftext|>"])
base.TextModel._set_vocab_gpt2 = with_inert_merge
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
"""


def source_tree(log: Any = print) -> Path:
    """The vendored llama.cpp tree of the pinned sdist, downloaded and unpacked once."""
    unpacked = CACHE / f"{SDIST.replace('-', '_')}-{SDIST_VERSION}"
    tree = unpacked / "vendor" / "llama.cpp"
    if tree.is_dir():
        return tree
    CACHE.mkdir(exist_ok=True)
    archive = CACHE / f"{unpacked.name}.tar.gz"
    if not archive.exists():
        log(f"downloading {SDIST}=={SDIST_VERSION}'s source (it vendors llama.cpp) ...")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", f"{SDIST}=={SDIST_VERSION}", "-d", str(CACHE)], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(CACHE, filter="data")
    return tree


def build_server(tree: Path, log: Any = print) -> Path:
    """`llama-server` built from ``tree`` (once: about 20 minutes on 2 cores)."""
    binary = tree / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    log("building llama-server from the vendored llama.cpp (once, ~20 minutes) ...")
    subprocess.run(["cmake", "-S", str(tree), "-B", str(tree / "build"), *CMAKE_FLAGS],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(tree / "build"), "--target", "llama-server",
                    "-j2"], check=True, stdout=subprocess.DEVNULL)
    return binary


def find_server(given: str | None, may_build: bool, log: Any = print) -> tuple[Path, Path]:
    """The server binary (``given``, else the cache's, built there if ``may_build``) and
    the source tree whose converter makes the GGUF file."""
    tree = source_tree(log)
    built = tree / "build" / "bin" / "llama-server"
    if not given and not may_build and not built.exists():
        raise FileNotFoundError(f"no llama-server at {built}, and this run builds none")
    return (Path(given) if given else build_server(tree, log)), tree


def version(binary: Path, tree: Path) -> dict[str, Any]:
    """What llama.cpp this is: the server's own ``--version``, and the vendored commit."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                          timeout=30)
    lines = [line for line in (done.stdout + done.stderr).splitlines()
             if line.startswith(("version", "built with"))]
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"],
                            capture_output=True, text=True)
    return {"server": str(binary), "server_version": lines,
            "source": f"{SDIST} {SDIST_VERSION} sdist, vendor/llama.cpp",
            "source_commit": commit.stdout.strip() or None}


def convert(hf_dir: Path, folder: Path, tree: Path, textlm: bool) -> Path:
    """A float32 GGUF file of the directory; textlm's export through a copy given
    ``n_ctx`` and the converter's shims (the module docstring)."""
    source, script = hf_dir, ["convert_hf_to_gguf.py"]
    if textlm:
        source = folder / "hf-for-gguf"
        shutil.copytree(hf_dir, source)
        config = json.loads((source / "config.json").read_text())
        config["n_ctx"] = config["n_positions"]
        (source / "config.json").write_text(json.dumps(config, indent=2))
        script = ["-c", CONVERT]
    out = folder / f"{hf_dir.name}-f32.gguf"
    path = f"{tree}:{tree / 'gguf-py'}"
    subprocess.run([sys.executable, *script, str(source), "--outfile", str(out),
                    "--outtype", "f32"], cwd=tree, check=True, capture_output=True, text=True,
                   env={**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"})
    return out


def server_command(binary: Path, gguf: Path, port: int, slots: int, context: int
                   ) -> list[str]:
    """One thread, ``slots`` parallel sequences of ``context`` tokens each (prompt and
    completion together), logging errors only (its stderr is a pipe nobody reads while it
    serves)."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--threads", "1", "--threads-batch", "1", "--parallel", str(slots),
            "--ctx-size", str(slots * context), "--no-webui", "--log-verbosity", "1"]


def request_body(greedy: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's greedy request; an untrained model may end early, and every
    contender generates all it is asked for."""
    return {**greedy, "ignore_eos": True}


def check_tokens(url: str, prompt: str, wanted: list[int]) -> str | None:
    """Why the server's tokens for ``prompt`` differ from ``wanted`` (the model's own
    tokenizer's), or None when they agree."""
    ids = httpx.post(url + "/tokenize", json={"content": prompt}, timeout=30).json()["tokens"]
    return None if ids == wanted else f"llama.cpp tokenized the prompt as {ids[:16]}..."


def contender(servers: Any, hf_dir: Path, folder: Path, greedy: dict[str, Any],
              given: str | None, slots: int, tokens: int, may_build: bool,
              prompt: tuple[str, list[int]], context: int, textlm: bool
              ) -> tuple[Contender, dict[str, Any]] | None:
    """llama-server on a GGUF conversion of the directory, with ``slots`` slots of
    ``context`` tokens, started by the benchmark's ``servers``, sent ``greedy``; None (and
    a note) where it cannot be found, built, converted to or started, or where it
    tokenizes the prompt's text otherwise than the directory's tokenizer (``prompt``: the
    text and those ids)."""
    try:
        binary, tree = find_server(given, may_build)
        gguf = convert(hf_dir, folder, tree, textlm)
        about = version(binary, tree)
    except (OSError, subprocess.SubprocessError) as exc:
        stderr = getattr(exc, "stderr", None)
        servers.notes.append(f"llama.cpp skipped: {exc}" + (
            f": {stderr[-1000:]}" if isinstance(stderr, str) else ""))
        return None
    command = server_command(binary, gguf, free_port(), slots, context)
    url = servers.start("llama.cpp", command, "/health", 180)
    if url is None:
        return None
    if (why := check_tokens(url, *prompt)) is not None:
        servers.notes.append(f"llama.cpp skipped: {why}")
        stop([servers.processes.pop()])
        servers.started.pop()
        return None
    about |= {"command": command, "gguf": "float32, by the vendored convert_hf_to_gguf.py"
              + (" with the shims contenders/llama_cpp.py describes" if textlm else "")
              + "; the prompt's tokens checked against the directory's tokenizer"}
    return Contender("llama.cpp", url, "/v1/completions", request_body(greedy), True,
                     tokens), about


def judge(runs: dict[str, dict[str, Any]], model: str, ours: str = "gpuflow",
          theirs: str = "llama.cpp") -> dict[str, Any]:
    """gpuflow's engine against llama-server, by concurrency: the tokens/s ratio against
    the issue's target for ``model`` (``TARGETS``)."""
    verdicts: dict[str, Any] = {}
    mine, other = runs.get(ours), runs.get(theirs)
    for level, target in TARGETS[model].items():
        if not mine or not other or level not in mine or level not in other:
            continue
        if not other[level]["tokens_per_s"]:
            continue
        ratio = mine[level]["tokens_per_s"] / other[level]["tokens_per_s"]
        verdicts[f"{ours} vs {theirs} c{level}"] = {
            "tokens_per_s_ratio": ratio, "target_min": target, "met": ratio >= target,
            "ttft_p50_ms": {ours: mine[level]["ttft_p50_ms"],
                            theirs: other[level]["ttft_p50_ms"]}}
    return verdicts
