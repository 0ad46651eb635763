"""`/v1/predict` on sequence models through the default codec: any length from 1 up to the
context, requests of different lengths batched with padding (and a built attention mask)
exactly as each alone, clear refusals out of range, and old fixed-shape schemas as before."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import eventually, serving
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from gpuflow.input_schema import InputField, InputSchema, sequence_schema
from gpuflow.serve.app import ServeSettings, create_app
from gpuflow.serve.engine import Engine, EngineOptions
from gpuflow.serve.model import LoadedModel, Runner
from gpuflow.serving import InputError, PredictRequest, TensorCodec
from gpuflow.workload import Workload, make_codec, serving_state

CONTEXT = 64


class CausalMean(nn.Module):
    """A plain sequence model: each position's logits from the mean of the embeddings up
    to it, so padding after a sequence never reaches it."""

    def __init__(self, vocab: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens).cumsum(1)
        return self.head(hidden / torch.arange(1, tokens.shape[1] + 1)[:, None])


class Windows(Dataset):
    """Token windows as a tokenizer hands them: dicts of input_ids and attention_mask."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        ids = self.tokens[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, max_position_embeddings=CONTEXT)
    return transformers.LlamaForCausalLM(config).eval()


def tokens(count: int, length: int, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (count, length), generator=torch.Generator().manual_seed(1))


def llama_workload(model: nn.Module, as_dict: bool = False) -> Workload:
    """The model trained on 16-token windows: given as a tensor, or as dicts with a mask."""
    windows = tokens(4, 16)
    data = Windows(windows) if as_dict else TensorDataset(windows, windows)
    return Workload("llama", model, data)


def codec_of(workload: Workload) -> TensorCodec:
    """The codec a server builds, from the state saved at training, through JSON."""
    codec = make_codec(workload, json.loads(json.dumps(serving_state(workload))))
    assert isinstance(codec, TensorCodec)
    return codec


def own_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """The model's own forward on one unpadded sequence."""
    with torch.inference_mode():
        output = model(torch.tensor([ids]))
    return getattr(output, "logits", output)[0]


def test_the_saved_schema_marks_the_sequence_and_round_trips(llama: nn.Module) -> None:
    state = serving_state(llama_workload(llama, as_dict=True))
    fields = state["inputs"]["fields"]
    assert fields == [{"name": n, "dtype": "int64", "shape": [None], "max_length": CONTEXT}
                      for n in ("input_ids", "attention_mask")]
    schema = InputSchema.from_json(json.loads(json.dumps(state["inputs"])))
    assert schema.to_json() == state["inputs"] and schema.max_length == CONTEXT
    assert schema.fields[0].describe() == "[N, 1..64] int64"
    # GPT-2 names its context n_positions; a float input of a Hugging Face model keeps its
    # shape; a plain model's sequence comes from the workload.
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=48, n_embd=16, n_layer=1, n_head=2))
    mixed = InputSchema.of({"input_ids": tokens(2, 8), "scores": torch.zeros(2, 8)}, gpt2)
    assert [f.to_json() for f in sequence_schema(mixed, gpt2, None).fields] == [
        {"name": "input_ids", "dtype": "int64", "shape": [None], "max_length": 48},
        {"name": "scores", "dtype": "float32", "shape": [8]}]
    plain = Workload("mean", CausalMean(), TensorDataset(tokens(4, 12, 32), tokens(4, 12, 32)),
                     max_sequence_length=40)
    assert serving_state(plain)["inputs"]["fields"][0]["max_length"] == 40
    unsized = Workload("mean", CausalMean(), TensorDataset(tokens(4, 12, 32), torch.zeros(4)))
    assert serving_state(unsized)["inputs"]["fields"][0] == {
        "name": "inputs", "dtype": "int64", "shape": [12]}


@pytest.mark.parametrize("as_dict", [False, True], ids=["built-mask", "own-mask"])
def test_different_lengths_batched_together_equal_each_alone(llama: nn.Module,
                                                             as_dict: bool) -> None:
    codec = codec_of(llama_workload(llama, as_dict))
    # The tensor-fed model is called by keyword with a mask it is built; the dict-fed one
    # gets its own mask, padded with zeros.
    assert codec.keywords == (None if as_dict else ("input_ids",))
    runner = Runner(llama, "cpu")
    prompts = [tokens(1, 22)[0].tolist(), tokens(2, 5)[1].tolist()]

    def request(ids: list[int]) -> PredictRequest:
        if as_dict:
            return PredictRequest(inputs={"input_ids": [ids], "attention_mask": [[1] * len(ids)]})
        return PredictRequest(inputs=[ids])

    decoded = [codec.decode(request(ids)) for ids in prompts]
    assert [d.key for d in decoded] == [("tensor", 32), ("tensor", 16)]
    together = codec.run(runner, decoded[0].key, decoded[0].rows + decoded[1].rows)
    for ids, alone, batched in zip(prompts, decoded, together, strict=True):
        [single] = codec.run(runner, alone.key, alone.rows)
        assert batched["logits"].shape == (len(ids), 128)
        torch.testing.assert_close(batched["logits"], single["logits"], atol=1e-5, rtol=0)
        torch.testing.assert_close(batched["logits"], own_logits(llama, ids), atol=1e-5, rtol=0)


def test_a_plain_sequence_model_takes_any_length_up_to_its_declared_maximum() -> None:
    torch.manual_seed(0)
    model = CausalMean().eval()
    data = TensorDataset(tokens(4, 12, 32), tokens(4, 12, 32))
    codec = codec_of(Workload("mean", model, data, max_sequence_length=40))
    assert codec.keywords is None  # its forward takes no mask
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2, 3]]
    decoded = codec.decode(PredictRequest(inputs=prompts))
    assert decoded.key == ("tensor", 32)
    outputs = codec.run(Runner(model, "cpu"), decoded.key, decoded.rows)
    for ids, output in zip(prompts, outputs, strict=True):
        torch.testing.assert_close(output["output"], own_logits(model, ids), atol=1e-6, rtol=0)
    with pytest.raises(InputError, match=r"inputs\[1\] has 41 tokens; this model takes 1 to "
                                         r"40: \[N, 1\.\.40\] int64\."):
        codec.decode(PredictRequest(inputs=[[1], [1] * 41]))
    # A packed sample (offline predict) and a JSON request file.
    assert codec.from_sample(torch.tensor(prompts[0]), {}).key == ("tensor", 16)


def test_out_of_range_and_mismatched_sequences_are_refused(llama: nn.Module,
                                                           tmp_path: Path) -> None:
    codec = codec_of(llama_workload(llama, as_dict=True))
    refusals = {
        "too long": ([1] * 65, [1] * 65,
                     "inputs.input_ids has 65 tokens; this model takes 1 to 64: "
                     "[N, 1..64] int64."),
        "empty": ([], [], "inputs.input_ids has 0 tokens; this model takes 1 to 64: "
                          "[N, 1..64] int64."),
        "unequal": ([1, 2, 3], [1, 1], "a sample's sequences must be equally long; got "
                                       "input_ids 3, attention_mask 2."),
        "not a sequence": ([[1, 2]], [[1, 1]], "inputs.input_ids has shape [1, 2]; this "
                                               "model takes [N, 1..64] int64."),
    }
    for name, (ids, mask, message) in refusals.items():
        with pytest.raises(InputError) as caught:
            codec.decode(PredictRequest(inputs={"input_ids": [ids], "attention_mask": [mask]}))
        assert str(caught.value) == message, name
    request = tmp_path / "long.json"
    request.write_text(json.dumps({"inputs": {"input_ids": [[1] * 65],
                                              "attention_mask": [[1] * 65]}}))
    with pytest.raises(InputError, match="has 65 tokens"):
        codec.decode_file(request, {})
    with pytest.raises(InputError, match="a packed sample's input_ids has 65 tokens"):
        ones = torch.ones(65, dtype=torch.int64)
        codec.from_sample({"input_ids": ones, "attention_mask": ones}, {})


def test_an_old_fixed_shape_schema_is_served_as_before(llama: nn.Module) -> None:
    old = {"inputs": {"call": "tensor", "fields": [
        {"name": "inputs", "dtype": "int64", "shape": [16]}]}}
    codec = make_codec(llama_workload(llama), old)
    assert isinstance(codec, TensorCodec) and codec.schema.max_length is None
    assert codec.fields == (InputField("inputs", "int64", (16,)),) and codec.keywords is None
    with pytest.raises(InputError, match=r"inputs has shape \[1, 22\]; this model takes "
                                         r"\[N, 16\] int64\."):
        codec.decode(PredictRequest(inputs=tokens(1, 22).tolist()))
    ids = tokens(2, 16)
    decoded = codec.decode(PredictRequest(inputs=ids.tolist()))
    assert decoded.key == "tensor" and codec.warmup_rows()[0][0] == "tensor"
    [first, _] = codec.run(Runner(llama, "cpu"), decoded.key, decoded.rows)
    torch.testing.assert_close(first["logits"], own_logits(llama, ids[0].tolist()),
                               atol=1e-5, rtol=0)


def test_warm_up_runs_every_shape_only_for_a_static_shape_runner(llama: nn.Module) -> None:
    loaded = LoadedModel(llama_workload(llama), {}, 0, Path("llama"))
    engine = Engine(loaded, EngineOptions(device="cpu", max_batch_size=4))
    assert [(key, len(rows)) for key, rows in engine.warmup_batches()] == [(("tensor", 16), 1)]
    assert engine.warm_up() > 0
    engine.runner.compiled = True  # as --compile sets it, without compiling here
    assert [(key, len(rows)) for key, rows in engine.warmup_batches()] == [
        (("tensor", length), size) for length in (16, 32, 64) for size in (1, 2, 4)]
    # Nine shapes: past dynamo's default limit of 8 graphs the ninth would run eagerly.
    with torch._dynamo.config.patch(recompile_limit=8):
        engine.warm_up()
        assert torch._dynamo.config.recompile_limit == 9
    # Compiled, a batch is padded to its batch bucket, and only its own rows come back.
    decoded = engine.codec.decode(PredictRequest(inputs=tokens(3, 20).tolist()))
    assert len(engine.run(decoded.key, decoded.rows)) == 3


class HeldEngine(Engine):
    """An engine that records each batch's key and row lengths and holds batches at a gate,
    so requests arriving meanwhile queue and form the next batch."""

    def __init__(self, loaded: LoadedModel, options: EngineOptions) -> None:
        super().__init__(loaded, options)
        self.batches: list[tuple[Any, list[int]]] = []
        self.entered, self.gate = threading.Event(), threading.Event()

    def run(self, key: Any, rows: list[Any]) -> list[Any]:
        self.batches.append((key, [self.codec.schema.length(row) for row in rows]))
        self.entered.set()
        assert self.gate.wait(30)
        return super().run(key, rows)


def test_predict_over_http_batches_different_lengths_up_to_the_context(
        llama: nn.Module) -> None:
    # Batches held at the gate must not hold the event loop too: none runs inline.
    settings = ServeSettings(source="llama", device="cpu", max_batch_size=8, inline_below_ms=0,
                             engine_process=False)
    engine = HeldEngine(LoadedModel(llama_workload(llama), {}, 0, Path("llama")),
                        settings.engine_options())
    prompts = [tokens(1, 64)[0].tolist(), tokens(1, 22)[0].tolist(), tokens(2, 18)[1].tolist()]

    async def scenario() -> tuple[list[Any], Any, Any]:
        app = create_app(settings, load=lambda: engine)
        async with serving(app) as client:
            def post(ids: list[int]) -> asyncio.Task[Any]:
                return asyncio.create_task(client.post("/v1/predict", json={"inputs": [ids]}))

            first = post(prompts[0])
            assert await asyncio.to_thread(engine.entered.wait, 10)
            queued = [post(ids) for ids in prompts[1:]]
            await eventually(lambda: app.state.serve.batcher.depth == 2)
            engine.gate.set()
            replies = [await first, *[await reply for reply in queued]]
            too_long = await client.post("/v1/predict", json={"inputs": [[1] * 300]})
            empty = await client.post("/v1/predict", json={"inputs": [[]]})
        return replies, too_long, empty

    replies, too_long, empty = asyncio.run(scenario())
    assert engine.batches == [(("tensor", 64), [64]), (("tensor", 32), [22, 18])]
    for ids, reply in zip(prompts, replies, strict=True):
        assert reply.status_code == 200, reply.text
        logits = torch.tensor(reply.json()["predictions"][0]["outputs"]["logits"])
        torch.testing.assert_close(logits, own_logits(llama, ids), atol=1e-5, rtol=0)
    for refused, count in ((too_long, 300), (empty, 0)):
        assert refused.status_code == 422
        error = refused.json()["error"]
        assert error["code"] == "invalid_input"
        assert error["message"] == (f"inputs has {count} tokens; this model takes 1 to 64: "
                                    "[N, 1..64] int64.")
