"""verl_npu.ci.gsm8k: the nightly jobs' GSM8K, from a raw openai/gsm8k copy to verl's RL parquet."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from support.paths import REPO

from verl_npu.ci import gsm8k

TRAIN = [
    ("Mia packs 3 boxes of 12 pens. How many pens?", "3 boxes * 12 = <<3*12=36>>36 pens.\n#### 36"),
    ("A farm sells 1,200 eggs a day for 5 days. How many?", "1200 * 5 = <<1200*5=6000>>6000\n#### 6,000"),
    ("Temperature falls 4 degrees from 1. What is it now?", "1 - 4 = <<1-4=-3>>-3\n#### -3"),
]
TEST = [("Leo reads 7 pages a day for 3 days. How many pages?", "7 * 3 = <<7*3=21>>21\n#### 21")]


def write_raw(root: Path, split: str, rows: list[tuple[str, str]], shard: int = 0, shards: int = 1) -> Path:
    """One shard in openai/gsm8k's repository layout: main/<split>-0000N-of-0000M.parquet."""
    path = root / "main" / f"{split}-{shard:05d}-of-{shards:05d}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows, columns=["question", "answer"]).to_parquet(path, index=False)
    return path


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    root = tmp_path / "datasets" / "openai" / "gsm8k"
    write_raw(root, "train", TRAIN)
    write_raw(root, "test", TEST)
    return root


def test_rows_are_in_verls_rl_layout_with_the_final_number_as_ground_truth(raw, tmp_path):
    outputs, written = gsm8k.prepare(raw, tmp_path / "out")
    assert written and set(outputs) == {"train", "test"}
    train = pd.read_parquet(outputs["train"])
    assert list(train.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert len(train) == 3 and len(pd.read_parquet(outputs["test"])) == 1
    first = train.iloc[0]
    assert first["data_source"] == "openai/gsm8k" and first["ability"] == "math"
    (message,) = list(first["prompt"])
    assert message["role"] == "user"
    assert message["content"].startswith(TRAIN[0][0]) and '"####"' in message["content"]
    assert [r["ground_truth"] for r in train["reward_model"]] == ["36", "6000", "-3"]
    assert {r["style"] for r in train["reward_model"]} == {"rule"}
    info = train.iloc[1]["extra_info"]
    assert info == {"split": "train", "index": 1, "answer": TRAIN[1][1], "question": TRAIN[1][0]}


def test_verls_default_reward_scores_a_response_against_the_prepared_ground_truth(raw, tmp_path):
    from verl.utils.reward_score import default_compute_score

    outputs, _ = gsm8k.prepare(raw, tmp_path / "out")
    row = pd.read_parquet(outputs["train"]).iloc[1]
    truth = row["reward_model"]["ground_truth"]
    assert default_compute_score(row["data_source"], "1200 a day, so 6000 in all.\n#### 6,000", truth) == 1
    assert default_compute_score(row["data_source"], "about 6000 eggs", truth) == 0  # no "####": no reward
    assert default_compute_score(row["data_source"], "#### 5999", truth) == 0


def test_indices_run_over_all_shards_of_a_split(tmp_path):
    root = tmp_path / "gsm8k"
    write_raw(root, "train", TRAIN[:2], shard=0, shards=2)
    write_raw(root, "train", TRAIN[2:], shard=1, shards=2)
    write_raw(root, "test", TEST)
    outputs, _ = gsm8k.prepare(root, tmp_path / "out")
    train = pd.read_parquet(outputs["train"])
    assert [info["index"] for info in train["extra_info"]] == [0, 1, 2]
    assert [info["question"] for info in train["extra_info"]] == [q for q, _ in TRAIN]


def test_a_second_run_keeps_the_files_and_a_changed_source_rewrites_them(raw, tmp_path):
    out = tmp_path / "out"
    outputs, written = gsm8k.prepare(raw, out)
    before = {split: path.stat().st_mtime_ns for split, path in outputs.items()}
    outputs, written = gsm8k.prepare(raw, out)
    assert not written
    assert {split: path.stat().st_mtime_ns for split, path in outputs.items()} == before
    write_raw(raw, "test", [*TEST, ("Two more?", "#### 2")])
    outputs, written = gsm8k.prepare(raw, out)
    assert written and len(pd.read_parquet(outputs["test"])) == 2
    # the stamp is written last: outputs without it (a run killed between the two splits) are redone
    outputs["train"].write_bytes(b"")
    (out / gsm8k.STAMP).unlink()
    _, written = gsm8k.prepare(raw, out)
    assert written and len(pd.read_parquet(outputs["train"])) == 3
    assert sorted(p.name for p in out.iterdir()) == sorted([gsm8k.STAMP, "test.parquet", "train.parquet"])


def test_a_missing_split_names_the_expected_file_and_the_runners_location(tmp_path):
    with pytest.raises(gsm8k.Gsm8kError) as missing_dir:
        gsm8k.prepare(tmp_path / "nowhere", tmp_path / "out")
    assert "nowhere/main/train-*.parquet" in str(missing_dir.value)
    assert "does not exist" in str(missing_dir.value)
    assert "/root/.cache/datasets/openai/gsm8k" in str(missing_dir.value)
    root = tmp_path / "flat"
    root.mkdir()
    pd.DataFrame(TRAIN, columns=["question", "answer"]).to_parquet(root / "train.parquet")
    with pytest.raises(gsm8k.Gsm8kError, match=r"it holds train\.parquet.*main/train-00000-of-00001\.parquet"):
        gsm8k.prepare(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_raw_file_of_another_shape_is_named_with_what_is_wrong(tmp_path):
    root = tmp_path / "gsm8k"
    path = root / "main" / "train-00000-of-00001.parquet"
    path.parent.mkdir(parents=True)
    pd.DataFrame({"problem": ["x"], "answer": ["#### 1"]}).to_parquet(path)
    write_raw(root, "test", TEST)
    with pytest.raises(gsm8k.Gsm8kError, match=r"train-00000-of-00001\.parquet: no column 'question'"):
        gsm8k.prepare(root, tmp_path / "out")
    write_raw(root, "train", [*TRAIN, ("What?", "It is seven.")])
    with pytest.raises(gsm8k.Gsm8kError, match=r"train-00000-of-00001\.parquet row 3: the answer does not end in"):
        gsm8k.prepare(root, tmp_path / "out")
    write_raw(root, "train", [("What?", "#### seven")])
    with pytest.raises(gsm8k.Gsm8kError, match="found 'seven'"):
        gsm8k.prepare(root, tmp_path / "out")


def test_the_command_line_reports_errors_with_exit_2_and_writes_on_success(raw, tmp_path):
    command = [sys.executable, "-m", "verl_npu.ci.gsm8k"]
    done = subprocess.run(
        [*command, str(tmp_path / "nowhere"), str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "main/train-*.parquet" in done.stderr
    done = subprocess.run([*command, str(raw), str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("wrote ") and (tmp_path / "out/train.parquet").is_file()
    done = subprocess.run([*command, str(raw), str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO)
    assert done.stdout.startswith("up to date: ")
