"""InferenceObjective parsing, the objective table and the file watcher's reloads."""

from __future__ import annotations

from pathlib import Path

import pytest

from smart_epp.epp.flowcontrol.objectives import (
    Objective,
    ObjectivesError,
    ObjectivesFileWatcher,
    ObjectiveTable,
    parse_objectives,
)

LIST = """
- apiVersion: inference.networking.x-k8s.io/v1alpha2
  kind: InferenceObjective
  metadata: {name: critical}
  spec: {priority: 2, poolRef: {name: pool-a}}
- kind: InferenceObjective
  metadata: {name: batch}
  spec: {priority: -1}
- kind: InferenceObjective
  metadata: {name: plain}
"""

MULTI = """
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: critical}
spec: {priority: 5}
---
kind: InferenceObjective
metadata: {name: other-pool}
spec: {priority: 9, poolRef: {name: pool-b}}
"""


def test_a_list_of_objects() -> None:
    found = parse_objectives(LIST)
    assert found == {
        "critical": Objective("critical", 2, "pool-a"),
        "batch": Objective("batch", -1),
        "plain": Objective("plain", 0),
    }
    assert found["batch"].sheddable and not found["plain"].sheddable


def test_multi_document_and_pool_filter() -> None:
    assert set(parse_objectives(MULTI)) == {"critical", "other-pool"}
    only_a = parse_objectives(MULTI, pool="pool-a")
    assert only_a == {"critical": Objective("critical", 5)}


def test_kubernetes_list_kind() -> None:
    text = (
        "kind: List\nitems:\n"
        "- kind: InferenceObjective\n  metadata: {name: x}\n  spec: {priority: 1}\n"
    )
    assert parse_objectives(text) == {"x": Objective("x", 1)}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- kind: InferenceObjective\n  spec: {priority: 1}\n", "metadata.name is required"),
        ("- kind: InferenceObjective\n  metadata: {name: a}\n  spec: {priority: high}\n",
         "spec.priority must be an integer"),
        ("- kind: InferencePool\n  metadata: {name: a}\n", "is not InferenceObjective"),
        ("- kind: InferenceObjective\n  metadata: {name: a}\n"
         "- kind: InferenceObjective\n  metadata: {name: a}\n", "defined twice"),
        ("- [unclosed\n", "not valid YAML"),
    ],
)  # fmt: skip
def test_bad_documents_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(ObjectivesError, match=message):
        parse_objectives(text, "objs.yaml")


def test_unknown_names_get_the_default_priority_and_are_counted() -> None:
    heard: list[str] = []
    table = ObjectiveTable(parse_objectives(LIST), on_unknown=heard.append)
    assert table.priority("critical") == 2
    assert table.priority("batch") == -1
    assert table.priority(None) == 0 and table.priority("") == 0
    assert table.priority("nobody-defined-this") == 0
    assert table.unknown == 1 and heard == ["nobody-defined-this"]


def test_file_watcher_reloads_on_change_and_keeps_the_last_good_set(tmp_path: Path) -> None:
    path = tmp_path / "objectives.yaml"
    path.write_text(LIST)
    table = ObjectiveTable()
    watcher = ObjectivesFileWatcher(path, table)
    assert watcher.poll() is True
    assert table.priority("critical") == 2
    assert watcher.poll() is False  # unchanged: not re-read

    path.write_text(MULTI)
    assert watcher.poll() is True
    assert table.priority("critical") == 5
    assert table.get("batch") is None

    path.write_text("- kind: InferenceObjective\n  spec: {}\n")  # broken: keep the last set
    assert watcher.poll() is False
    assert watcher.errors == 1
    assert table.priority("critical") == 5

    path.unlink()
    assert watcher.poll() is False
    assert table.priority("critical") == 5


def test_recorded_traffic_carries_objectives_and_slos_into_the_replay(tmp_path: Path) -> None:
    from smart_epp.benchmarks.replay.traces import load_recorded
    from smart_epp.epp.traffic_recorder import recorded_line

    path = tmp_path / "traffic.jsonl"
    path.write_text(
        recorded_line(0.0, "tiny", 10, 2, objective="critical", slo_ttft_ms=2000) + "\n"
        + recorded_line(0.5, "tiny", 10, 2) + "\n"
    )  # fmt: skip
    first, second = load_recorded(path)
    assert (first.objective, first.slo_ttft_s) == ("critical", 2.0)
    assert (second.objective, second.slo_ttft_s) == (None, None)
