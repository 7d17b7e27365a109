"""A model in a Hugging Face hub cache, laid out as `hf download` leaves it."""

from __future__ import annotations

from pathlib import Path


def hub_snapshot(hub: Path, repo_id: str, tokenizer_json: str, revision: str = "0123abcd") -> Path:
    """Writes `repo_id`'s tokenizer.json under `hub` (refs/main naming the snapshot);
    returns the snapshot folder."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    (snapshot / "tokenizer.json").write_text(tokenizer_json)
    return snapshot
