"""runtime.observe.memory_tracker against hand-counted bytes, on real and fake tensors."""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from runtime.observe.memory_tracker import MemoryTracker


def test_counts_storages_once_and_follows_frees():
    tracker = MemoryTracker()
    with tracker:
        a = torch.zeros(1000)                  # 4000 bytes
        view = a.view(10, 100)                 # same storage: nothing more
        b = a * 2                              # 4000 more
        assert tracker.current_bytes == 8000
        del b
        assert tracker.current_bytes == 4000
        c = torch.zeros(250)                   # 1000
    assert tracker.peak_bytes == 8000
    assert tracker.current_bytes == 5000
    del view, c


def test_split_by_marks_and_by_who_made_it():
    tracker = MemoryTracker()
    with tracker:
        layer = torch.nn.Linear(100, 100)      # 40000 + 400 bytes of parameters
        tracker.mark(layer.parameters(), "parameters")
        tracker.watch_gradients(layer.parameters())
        x = torch.zeros(8, 100, requires_grad=True)           # 3200, made by a "forward"
        y = layer(x).relu()                                   # 3200 saved by relu
        y.sum().backward()                                    # gradients 40400, x.grad 3200
        split = tracker.split()
    assert split["parameters"] == 40400
    assert split["gradients"] == 40400                        # marked as autograd made them
    # x and relu's output, and two scalars made outside the backward: the loss and the
    # gradient backward() starts from
    assert split["activations"] == 6400 + 4 + 4
    assert tracker.peak_bytes == sum(split.values())


def test_fake_tensors_of_its_mode_only_and_never_meta():
    fake = FakeTensorMode()
    tracker = MemoryTracker(fake_mode=fake)
    with fake, tracker:
        a = torch.empty(1000, 1000)            # 4 MB that do not exist
        torch.empty(10, device="meta")
        b = a @ a
    assert tracker.peak_bytes == 8_000_000
    other = MemoryTracker()                    # a real-tensor tracker ignores fake ones
    with fake, other:
        torch.empty(1000)
    assert other.peak_bytes == 0
    del b


def test_storage_resized_in_place():
    tracker = MemoryTracker()
    with tracker:
        a = torch.zeros(1000)
        a.untyped_storage().resize_(0)         # what ZeRO-3 does to a gathered buffer
        assert tracker.current_bytes == 0
        a.untyped_storage().resize_(4000)
        assert tracker.current_bytes == 4000
    assert torch.UntypedStorage.resize_ is not None and tracker.peak_bytes == 4000


def test_reset_peak_starts_from_what_is_alive():
    tracker = MemoryTracker()
    with tracker:
        big = torch.zeros(1000)
        del big
        keep = torch.zeros(10)
        tracker.reset_peak()
        torch.zeros(20)
    assert tracker.peak_bytes == 40 + 80
    del keep
