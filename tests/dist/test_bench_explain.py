"""`fxpar bench --explain` on real ranks (torchrun, gloo): every rank's measured step splits into
parts that add up to it, and the table and traces line them up with the predicted step."""
import dataclasses
import json

import pytest

from cost_model.hardware.cluster import PRESETS
from planner.api import plan
from planner.bench.plans import run_plan
from planner.bench.explain import explain_table, measured_parts, write_traces
from planner.models.presets import ModelConfig
from runtime.pipeline.generators import make_schedule

CONFIG = ModelConfig("gpt", 2, 32, 4, 64, 16, global_batch=4, name="bench-probe")
CLUSTER = dataclasses.replace(PRESETS["cpu-gloo"], action_overhead=1e-4, step_overhead=1e-3)


@pytest.fixture(scope="module")
def measured():
    chosen = plan(CONFIG, 4, cluster=CLUSTER, fix={"pp": 2, "dp": 2, "schedule": "zb-h1",
                                                  "mb": 1})[0]
    return chosen, run_plan(chosen, CONFIG, steps=3, warmup=1)


def test_every_rank_splits_its_step_into_parts_that_add_up(measured):
    chosen, result = measured
    assert sorted(r["rank"] for r in result.ranks) == [0, 1, 2, 3]
    for r in result.ranks:
        parts, stage = r["parts"], r["pp_rank"]
        assert sum(parts.values()) == pytest.approx(r["step_s"], rel=1e-6)
        assert min(parts.values()) >= 0, parts  # each step's parts from its own records
        assert {n for n in parts if n[0] in "FBIW"} == {f"F{stage}", f"I{stage}", f"W{stage}"}
        schedule = make_schedule(chosen.schedule, chosen.pp, chosen.num_microbatches)
        assert [text for text, _, _ in r["events"]] == \
            [str(a) for a in schedule.actions[stage] if a.is_compute]
        assert parts["optimizer"] > 0 and parts["dp sync"] > 0
    # stage 1 waits for stage 0's activations; stage 0 for stage 1's gradients
    assert all(p["p2p wait"] > 0 for p in measured_parts(chosen, result.ranks))


def test_the_table_and_the_traces_line_up_prediction_and_measurement(measured, tmp_path):
    chosen, result = measured
    table = explain_table(chosen, CLUSTER, result.ranks)
    rows = {line.split()[0] for line in table.splitlines()[2:-1]}
    assert {"F0", "I0", "W0", "F1", "I1", "W1", "p2p", "dp", "optimizer", "overhead",
            "idle", "step"} <= rows
    assert "rank 0" in table and "rank 1" in table and "largest gaps" in table
    trace = json.load(open(write_traces(chosen, CLUSTER, result.ranks,
                                        str(tmp_path / "trace.json"))))
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"predicted", "measured"}
    compute = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    actions = 3 * chosen.num_microbatches * chosen.pp  # F, I, W per stage and micro-batch
    assert len([e for e in compute if e["pid"] == 0]) == actions
    assert len([e for e in compute if e["pid"] == 1]) == actions * chosen.dp
