"""The host's drift since calibration: measured only against a profile that kept the reference,
and shown beside the prediction, which it leaves as it is."""
import dataclasses

from cost_model.cluster import get_cluster
from planner.api import plan
from planner.bench import Measured, report
from planner.host_speed import drift, reference_s


def test_no_reference_no_drift():
    assert drift(None) is None
    assert drift(get_cluster("cpu-gloo")) is None


def test_the_drift_is_the_reference_now_over_the_reference_kept():
    """Against a reference kept twice as long as the host takes now the host runs about twice as
    fast (wide bounds: the host's own speed moves between the two timings)."""
    now = reference_s()
    assert 0.25 < drift(dataclasses.replace(get_cluster("cpu-gloo"), host_probe_s=2 * now)) < 1.0


def test_the_report_shows_the_prediction_at_the_hosts_speed_beside_the_prediction():
    plans = plan("gpt-tiny", 2, cluster="cpu-gloo", top_k=2)
    predicted = [p.predicted.iteration_s for p in plans]
    results = [Measured(step_s=t * 1.5, tokens_per_s=1.0, peak_memory_bytes=0.0, losses=(),
                        host_drift=d) for t, d in zip(predicted, (1.25, 1.5))]
    text = report(plans, results)
    assert "host now/cal" in text and "pred x host/meas" in text
    rows = [line.split() for line in text.splitlines() if line[:1] in "12"]
    assert [row[-2:] for row in rows] == [["1.25", "0.83"], ["1.50", "1.00"]]
    assert [row[-7] for row in rows] == ["0.67", "0.67"]  # pred/meas as it was
    without = report(plans, [dataclasses.replace(m, host_drift=None) for m in results])
    assert "host now/cal" not in without


def test_a_profile_keeps_the_reference(tmp_path):
    from cost_model.cluster import load_profile, save_profile
    cluster = dataclasses.replace(get_cluster("cpu-gloo"), host_probe_s=0.003)
    path = tmp_path / "profile.json"
    save_profile(cluster, path)
    assert load_profile(path).host_probe_s == 0.003
