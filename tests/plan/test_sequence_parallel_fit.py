"""Sequence parallel is planned only where the sequence splits: each rank's seq/cp positions over
tp ranks. The rewrite refuses the rest, so a plan with sp there could not run."""
import pytest

from passes.capture.trace import capture
from passes.stages.program import Layout, rewrite
from passes.rewrite.sharding import ShardingError
from planner.api import plan
from planner.search.costs import PlanningError
from planner.models.presets import ModelConfig, build_model, example_batch
from tests.harness.two_streams import TwoStreamSpec

GPT = ModelConfig("gpt", 1, 16, 4, 64, 12, global_batch=2)


def _sp_layers(chosen):
    return [s for st in chosen.stages for s in st.strategies if "sp" in s.split("+")]


@pytest.mark.parametrize("seq,gpus,tp,cp", [(11, 4, 4, 1), (30, 4, 4, 1), (12, 8, 4, 2)])
def test_a_fixed_sp_strategy_is_refused_where_the_sequence_does_not_split(seq, gpus, tp, cp):
    fix = {"dp": gpus // (tp * cp), "tp": tp, "pp": 1, "cp": cp, "mb": 1, "strategy": "tp+sp"}
    with pytest.raises(PlanningError):
        plan(GPT.with_(seq=seq), gpus, cluster="cpu-gloo", fix=fix)
    fine = plan(GPT.with_(seq=seq + (-seq) % (2 * cp * tp)), gpus, cluster="cpu-gloo", fix=fix)[0]
    assert _sp_layers(fine)


def test_the_search_leaves_sp_out_where_the_sequence_does_not_split():
    for chosen in plan(GPT.with_(seq=12), 8, cluster="cpu-gloo", fix={"tp": 4, "cp": 2}, top_k=3):
        assert not _sp_layers(chosen), chosen.stages


def test_the_rewrite_names_the_per_rank_sequence_under_context_parallel():
    config = GPT.with_(seq=12)
    captured = capture(build_model(config), example_batch(config, 1))
    layout = Layout(4, tuple((b.name, "tp+sp") for b in captured.blocks),
                    (len(captured.layers),), cp=2)
    with pytest.raises(ShardingError, match="6 per rank of cp=2"):
        rewrite(captured, layout, 0, 0)


def test_a_sequence_length_read_from_a_sharded_stream_is_refused_at_planning():
    """Two streams joined for attention and cut at the text length read from the text stream's
    shape: under sequence parallelism that read is the rank's share of the text, so the cut is
    wrong - refused when planning (not when the ranks are built), naming why. Both blocks are
    one kind: the slice's bound is a node, not a constant of the block."""
    model, batch = TwoStreamSpec(text_len=None).build()
    with pytest.raises(ValueError, match=r"sequence parallel does not apply .* node getitem "
                                         r"\(txt_in\.shape\[1\]\) is 2 on each rank where the "
                                         r"model has 4: .* split along the sequence"):
        plan(model, 2, batch, cluster="cpu-gloo",
             fix={"dp": 1, "tp": 2, "pp": 1, "mb": 2, "strategy": "tp+sp"})
    chosen = plan(model, 2, batch, cluster="cpu-gloo", fix={"tp": 2, "pp": 1})[0]
    assert not any("kinds" in note for note in chosen.notes), chosen.notes
    assert "sp" not in " ".join(s for st in chosen.stages for s in st.strategies)
