"""What `fxpar train` reports (planner.training.metrics): the log line's figures, metrics.jsonl
across restarts (a step trained twice counts its latest attempt), the progress bar on a
terminal only, and the loss curve."""
import io
import json

import pytest

from planner.api import plan
from planner.training.metrics import Metrics, curves, plot_losses, read_metrics, step_flops


@pytest.fixture(scope="module")
def tiny_plan():
    return plan("llama-tiny", 2, cluster="cpu-gloo", fix={"dp": 2})[0]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_log_line_and_its_figures(tiny_plan, tmp_path):
    lines = []
    m = Metrics(str(tmp_path), 4, 2, tiny_plan, 100e9, log=lines.append, stream=io.StringIO())
    assert m.step(1, 5.0, 1e-3, 0.5, 0.1) is None and lines == []
    line = m.step(2, 4.5, 2e-3, 0.25, 0.1, peak_memory=2**30)
    tokens = tiny_plan.global_batch * tiny_plan.seq
    tflops = step_flops(tiny_plan) / 0.1 / 2 / 1e12
    assert line == lines[0]
    assert line.startswith(f"step 2/4  loss 4.5000  lr 0.002  grad norm 0.250  "
                           f"{tokens / 0.1:,.0f} tokens/s  {tflops:.3g} TFLOP/s per device  "
                           f"MFU {100 * tflops * 1e12 / 100e9:.2f}%  peak memory 1.00 GiB")
    m.eval(2, 4.7, 0.5, 3)
    assert lines[-1] == "eval at step 2: validation loss 4.7000 over 3 batches (0.5 s)"
    m.close()
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["kind"] for r in records] == ["train", "train", "eval"]
    assert records[1]["peak_memory_gib"] == 1.0 and records[0]["tokens_per_s"] == tokens / 0.1


def test_model_flops_are_the_plans(tiny_plan):
    """The plan's model FLOPs of a step: 6 x parameters x tokens, plus attention's."""
    from planner.models.presets import build_model
    params = sum(p.numel() for p in build_model("llama-tiny", device="meta").parameters())
    tokens = tiny_plan.global_batch * tiny_plan.seq
    ratio = step_flops(tiny_plan) / (6 * params * tokens)
    print(f"plan FLOPs / 6NT = {ratio:.3f}")
    assert 1.0 <= ratio < 1.2


def test_restarts_append_and_the_latest_attempt_wins(tiny_plan, tmp_path):
    for attempt, steps in ((0, (1, 2, 3)), (1, (3, 4))):
        m = Metrics(str(tmp_path), 4, 10, tiny_plan, 100e9, attempt=attempt,
                    log=lambda *_: None, stream=io.StringIO())
        m.record("start", step=steps[0] - 1, world_size=2, plan="p",
                 **({"resumed_from": 2} if attempt else {}))
        for s in steps:
            m.step(s, 10.0 * attempt + s, 1e-3, None, 0.1)
        m.close()
    train, val, starts = curves(read_metrics(str(tmp_path / "metrics.jsonl")))
    assert train == {1: 1.0, 2: 2.0, 3: 13.0, 4: 14.0} and val == {}
    assert [s["attempt"] for s in starts] == [0, 1]
    path = plot_losses(str(tmp_path / "metrics.jsonl"), str(tmp_path / "loss.png"), "t", 3.0)
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_bar_on_a_terminal_only(tiny_plan, tmp_path):
    term, pipe = _Terminal(), io.StringIO()
    for stream, folder in ((term, "a"), (pipe, "b")):
        m = Metrics(str(tmp_path / folder), 3, 10, tiny_plan, 100e9, stream=stream,
                    log=lambda *_: None)
        for s in (1, 2, 3):
            m.step(s, 1.0, 1e-3, None, 0.1)
        m.close()
    assert "[" in term.getvalue() and "3/3 steps" in term.getvalue()
    assert pipe.getvalue() == ""
    quiet = Metrics(str(tmp_path / "c"), 3, 10, tiny_plan, 100e9, enabled=False)
    assert quiet.step(3, 1.0, 1e-3, None, 0.1) is None
    assert not (tmp_path / "c" / "metrics.jsonl").exists()
    json.dumps(read_metrics(str(tmp_path / "a" / "metrics.jsonl")))
