import torch

from gpuflow.data.prefetch import DevicePrefetcher, move_to_device
from gpuflow.data.sampler import ResumableSampler


def test_prefetcher_yields_every_batch_in_order_on_cpu() -> None:
    batches = [(torch.full((2, 3), float(i)), torch.tensor([i, i])) for i in range(5)]
    seen = list(DevicePrefetcher(iter(batches), torch.device("cpu")))
    assert len(seen) == 5
    for (x, y), (ex, ey) in zip(seen, batches, strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_move_to_device_keeps_structure() -> None:
    batch = ({"a": torch.ones(2), "b": (torch.zeros(1), 3)}, torch.arange(2))
    moved = move_to_device(batch, torch.device("cpu"))
    assert isinstance(moved, tuple) and isinstance(moved[0]["b"], tuple)
    assert moved[0]["b"][1] == 3 and torch.equal(moved[1], torch.arange(2))


def test_sampler_resumes_mid_epoch_and_reshuffles_each_epoch() -> None:
    sampler = ResumableSampler(10, seed=3)
    sampler.set_position(epoch=1, start=0)
    full = list(sampler)
    sampler.set_position(epoch=1, start=4)
    assert list(sampler) == full[4:] and len(sampler) == 6
    sampler.set_position(epoch=2, start=0)
    other = list(sampler)
    assert sorted(other) == list(range(10)) and other != full


def test_batched_indexing_gives_the_same_batches_as_item_by_item() -> None:
    from itertools import islice

    from torch.utils.data import TensorDataset, default_collate

    from gpuflow.data.loader import supports_batched_indexing, train_batches

    data = TensorDataset(torch.randn(50, 3), torch.arange(50))
    assert supports_batched_indexing(data, None) and not supports_batched_indexing(data, len)
    common = dict(batch_size=8, collate=default_collate, seed=5, start_batch=3, num_workers=0,
                  pin_memory=False, rank=1, world_size=2)
    fast = list(islice(train_batches(data, batched_indexing=True, **common), 7))
    slow = list(islice(train_batches(data, batched_indexing=False, **common), 7))
    for (fx, fy), (sx, sy) in zip(fast, slow, strict=True):
        assert torch.equal(fx, sx) and torch.equal(fy, sy)


def test_background_loading_keeps_order_raises_errors_and_stops() -> None:
    import itertools
    import threading

    import pytest

    from gpuflow.data.prefetch import BackgroundLoader

    batches = [(torch.full((2,), float(i)), torch.tensor([i])) for i in range(6)]
    seen = list(DevicePrefetcher(iter(batches), torch.device("cpu"), background=True))
    assert [int(y) for _, y in seen] == list(range(6))

    def broken():
        yield 1
        raise ValueError("shard 3 is corrupt")

    loader = BackgroundLoader(broken())
    assert next(loader) == 1
    with pytest.raises(ValueError, match="shard 3 is corrupt"):
        next(loader)

    endless = BackgroundLoader(itertools.count())
    assert [next(endless) for _ in range(3)] == [0, 1, 2]
    endless.close()
    assert not any(t.name == "gpuflow-loader" for t in threading.enumerate())


def test_batches_that_move_themselves_move_in_the_loader_thread() -> None:
    import threading

    class Encoded:
        def __init__(self, value: int) -> None:
            self.value = value

        def to_device(self, device: torch.device, non_blocking: bool = False):  # noqa: ANN201
            return torch.tensor([self.value], device=device), threading.current_thread().name

    moved = list(DevicePrefetcher(iter([Encoded(i) for i in range(4)]), torch.device("cpu")))
    assert [int(x) for x, _ in moved] == [0, 1, 2, 3]
    # Not the consumer's thread, even without background loading: the decode overlaps.
    assert {thread for _, thread in moved} == {"gpuflow-loader"}
