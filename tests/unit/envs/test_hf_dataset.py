"""64.8: ``tasks.type: hf_dataset``: a Hugging Face dataset by id from the local cache (offline,
huggingface_hub's own lookup of a cache laid out as ``hf download --repo-type dataset`` leaves it) or
a local directory of its data files, one split's files read as task files."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.envs.tasks import source_tasks, split_tasks


def _cfg(path, **kw):
    return load_config(
        None, ["tasks.type=hf_dataset", f"tasks.path={path}", *(f"tasks.kwargs.{k}={v}" for k, v in kw.items())]
    ).tasks


def test_a_cached_dataset_by_id_and_a_local_directory(tmp_path, monkeypatch):
    commit = "1" * 40
    root = tmp_path / "hub" / "datasets--someorg--sums"
    snap = root / "snapshots" / commit / "data"
    snap.mkdir(parents=True)
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(30)]
    pq.write_table(pa.Table.from_pylist(rows[:20]), snap / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows[20:]), snap / "test-00000-of-00001.parquet")
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    train = source_tasks(_cfg("someorg/sums"))
    assert [t.answer for t in train] == [str(2 * a) for a in range(20)]
    assert [t.answer for t in source_tasks(_cfg("someorg/sums", split="test"))] == [str(2 * a) for a in range(20, 30)]
    training, heldout = split_tasks(_cfg("someorg/sums"))
    assert heldout and not {t.id for t in training} & {t.id for t in heldout}
    with pytest.raises(ConfigError, match=r"no data file of split 'validation'.*train-00000-of-00001.parquet"):
        source_tasks(_cfg("someorg/sums", split="validation"))
    with pytest.raises(ConfigError) as e:
        source_tasks(_cfg("someorg/absent"))
    assert "\n" not in str(e.value) and "hf download --repo-type dataset someorg/absent" in str(e.value)
    local = tmp_path / "local"
    local.mkdir()
    (local / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:5]))
    assert len(source_tasks(_cfg(local))) == 5
