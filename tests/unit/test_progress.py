"""runtime.launch.progress: a bar redrawn in place on a terminal, one plain line per update elsewhere."""
import io

from runtime.launch.progress import Progress, format_seconds


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_plain_lines_when_not_a_terminal():
    out, clock = io.StringIO(), Clock()
    bar = Progress(4, stream=out, tty=False, clock=clock)
    clock.t += 2.0
    bar.update(per_s=12345.6, loss=5.4321, label="4 ranks")
    clock.t += 2.0
    bar.update(advance=3, loss=5.0)
    lines = out.getvalue().splitlines()
    assert lines == ["step 1/4: 12,346 tokens/s, loss 5.4321, 6.0 s left (4 ranks)",
                     "step 4/4: loss 5.0000, done in 4.0 s"]
    assert "\r" not in out.getvalue()


def test_bar_redraws_in_place_on_a_terminal():
    out, clock = io.StringIO(), Clock()
    bar = Progress(2, stream=out, tty=True, clock=clock, width=10)
    clock.t += 1.0
    first = bar.update(per_s=100.0, loss=2.0)
    assert first == "[#####.....] 1/2 steps  100 tokens/s  loss 2.0000  1.0 s left"
    clock.t += 1.0
    bar.update(loss=1.5, label="done")
    text = out.getvalue()
    assert text.startswith("\r[#####.....] 1/2 steps") and text.endswith("\n")
    assert text.count("\r") == 2 and text.count("\n") == 1  # one line, drawn twice, then ended
    assert "[##########] 2/2 steps  loss 1.5000  done in 2.0 s  done" in text


def test_a_bar_left_short_ends_its_line_and_disabled_prints_nothing():
    out = io.StringIO()
    bar = Progress(5, stream=out, tty=True)
    bar.update()
    bar.close()
    assert out.getvalue().endswith("\n")
    quiet = io.StringIO()
    Progress(5, stream=quiet, tty=True, enabled=False).update()
    assert quiet.getvalue() == ""


def test_default_stream_is_stderr_and_its_terminal_decides(capsys):
    bar = Progress(1)
    bar.update(loss=1.0)
    err = capsys.readouterr().err
    assert err.startswith("step 1/1: loss 1.0000")  # captured stderr is no terminal


def test_format_seconds():
    assert format_seconds(12.34) == "12.3 s"
    assert format_seconds(245) == "4 min 05 s"
    assert format_seconds(3720) == "1 h 02 min"
    assert format_seconds(float("nan")) == "?"


def test_a_model_whose_inputs_are_not_sequences_counts_samples():
    """A DiT's progress counts images per second, as its plan does; a language model's, tokens."""
    from planner.models.presets import example_batch, get_config
    from planner.training.local import counted
    dit, gpt = get_config("dit-tiny"), get_config("gpt-tiny")
    assert counted(dit, example_batch(dit, 4)) == (4, "samples")
    assert counted(gpt, example_batch(gpt, 4)) == (4 * gpt.seq, "tokens")
    out = io.StringIO()
    Progress(2, stream=out, tty=False, rate_unit="samples").update(per_s=12.0)
    assert out.getvalue().startswith("step 1/2: 12 samples/s, ")
