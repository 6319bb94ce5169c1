"""Random tiny models × random fixed plans on 4 or 8 gloo ranks against one process.

tests.harness.fuzzing draws the model (GPT or Llama, 1-4 layers, grouped-query heads, prime vocabularies,
tied or not, sdpa or written-out attention) and the plan (mesh, schedule, v, micro-batch size,
one strategy for every block, the planner's per block or one drawn per block, vocabulary-parallel
ends); each accepted plan trains 2-3 steps and must match one process in losses, every gradient
and the final parameters (rtol 1e-5). A draw the planner refuses is not a failure: it is
discarded (its reason shows in --hypothesis-show-statistics). Derandomized and bounded, so the
same 10 cases run every time; examples/fuzz.py runs the same property for longer.
"""
import pytest
from conftest import rank_pool  # the session's pools (tests/conftest.py), restarted if closed
from hypothesis import HealthCheck, assume, event, given, settings

from tests.harness.fuzzing import Refused, cases, check, known_failure, plan_case


@pytest.mark.dist
@settings(max_examples=10, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.data_too_large])
@given(case=cases())
def test_random_plan_matches_one_process(case):
    known = known_failure(case)
    if known:
        event(f"skipped: {known}")
        assume(False)
    try:
        chosen = plan_case(case)
    except Refused as err:
        event(f"refused: {str(err).split(' (')[0][:100]}")
        assume(False)
    event(f"planned: {case.gpus} ranks, dp={chosen.dp} tp={chosen.tp} pp={chosen.pp} "
          f"cp={chosen.cp}")
    check(case, chosen, rank_pool(case.gpus))
