"""TensorBoard scalars of `fxpar train` (planner.training.metrics.Metrics), read back with
TensorBoard's own EventAccumulator: the loss, learning rate, gradient norm and tokens/s of every
step and the validation loss, equal to what was logged; after a restart the latest attempt's
value of a step trained twice, as in metrics.jsonl; nothing when turned off."""
import io

import pytest

pytest.importorskip("tensorboard")
pytest.importorskip("torch.utils.tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from planner.api import plan  # noqa: E402
from planner.training.metrics import Metrics, curves, read_metrics  # noqa: E402


@pytest.fixture(scope="module")
def tiny_plan():
    return plan("llama-tiny", 2, cluster="cpu-gloo", fix={"dp": 2})[0]


def scalars(folder) -> dict[str, dict[int, float]]:
    events = EventAccumulator(str(folder / "tensorboard"))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)}
            for tag in events.Tags()["scalars"]}


def steps_of(folder, tag) -> list[int]:
    events = EventAccumulator(str(folder / "tensorboard"))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def test_the_scalars_are_what_was_logged(tiny_plan, tmp_path):
    m = Metrics(str(tmp_path), 5, 2, tiny_plan, 100e9, tensorboard=True, log=lambda *_: None,
                stream=io.StringIO())
    logged = {s: (6.0 - 0.5 * s, 1e-3 * s, 0.1 * s if s != 3 else None, 0.05 * s)
              for s in range(1, 6)}
    for s, (loss, lr, grad_norm, seconds) in logged.items():
        m.step(s, loss, lr, grad_norm, seconds)
    m.eval(4, 3.25, 0.5, 2)
    m.close()
    got = scalars(tmp_path)
    assert set(got) == {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s",
                        "eval/loss"}
    approx = lambda d: pytest.approx(d, rel=1e-6)   # noqa: E731 - stored as float32
    assert got["train/loss"] == approx({s: v[0] for s, v in logged.items()})
    assert got["train/lr"] == approx({s: v[1] for s, v in logged.items()})
    assert got["train/grad_norm"] == approx({s: v[2] for s, v in logged.items() if v[2]})
    records = [r for r in read_metrics(str(tmp_path / "metrics.jsonl")) if r["kind"] == "train"]
    assert got["perf/tokens_per_s"] == approx({r["step"]: r["tokens_per_s"] for r in records})
    assert got["perf/tokens_per_s"][2] == pytest.approx(
        tiny_plan.global_batch * tiny_plan.seq / 0.1, rel=1e-6)
    assert got["eval/loss"] == approx({4: 3.25})


def test_a_restart_shows_the_latest_attempt(tiny_plan, tmp_path):
    """Attempt 0 logs steps 1-3 and is killed (its writer flushed at a logging step, never
    closed); attempt 1 resumes from the checkpoint of step 2: step 3 is attempt 1's only."""
    first = Metrics(str(tmp_path), 4, 3, tiny_plan, 100e9, tensorboard=True,
                    log=lambda *_: None, stream=io.StringIO())
    for s in (1, 2, 3):
        first.step(s, float(s), 1e-3, None, 0.1)
    second = Metrics(str(tmp_path), 4, 10, tiny_plan, 100e9, attempt=1, first_step=2,
                     tensorboard=True, log=lambda *_: None, stream=io.StringIO())
    for s in (3, 4):
        second.step(s, 10.0 + s, 1e-3, None, 0.1)
    second.close()
    train, _, _ = curves(read_metrics(str(tmp_path / "metrics.jsonl")))
    assert scalars(tmp_path)["train/loss"] == train == {1: 1.0, 2: 2.0, 3: 13.0, 4: 14.0}
    assert steps_of(tmp_path, "train/loss") == [1, 2, 3, 4]   # step 3 once
    first.close()


def test_off_writes_nothing_and_auto_writes(tiny_plan, tmp_path):
    for setting, folder in ((False, "off"), ("auto", "auto")):
        m = Metrics(str(tmp_path / folder), 2, 1, tiny_plan, 100e9, tensorboard=setting,
                    log=lambda *_: None, stream=io.StringIO())
        m.step(1, 2.0, 1e-3, None, 0.1)
        m.close()
    assert not (tmp_path / "off" / "tensorboard").exists()
    assert scalars(tmp_path / "auto")["train/loss"] == {1: 2.0}
