"""GSM8K in verl's RL parquet layout, made from the raw dataset files an Ascend runner caches.

    python -m verl_npu.ci.gsm8k RAW_DIR OUT_DIR

RAW_DIR is openai/gsm8k as its Hugging Face repository lays it out (``main/train-*.parquet`` and
``main/test-*.parquet``, columns ``question`` and ``answer``); the runners keep it under
/root/.cache/datasets/openai/gsm8k. OUT_DIR receives ``train.parquet`` and ``test.parquet`` with one row
per problem: ``data_source`` (``openai/gsm8k``, the key verl's default reward function dispatches its
GSM8K scorer on), ``prompt`` (one user message), ``ability``, ``reward_model`` (rule-scored against the
number after ``####`` in the reference answer) and ``extra_info``.

The verl wheel ships no ``examples/`` (so not upstream's preprocessing script); each nightly job runs
this into its own directory. Rerunning with the same raw files leaves OUT_DIR as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from verl_npu import atomic
from verl_npu.errors import UserError

DATA_SOURCE = "openai/gsm8k"
SPLITS = ("train", "test")
# verl's GSM8K scorer only accepts "#### <number>" at the end of a response (strict mode), so the prompt
# has to ask for exactly that form or every reward is 0.
INSTRUCTION = (
    "Reason step by step, then give the final answer as a number on the last line, "
    'after "####" (for example "#### 42").'
)
# Bumped whenever the rows change, so that an OUT_DIR written by an older version is rewritten.
FORMAT_VERSION = 1
STAMP = ".gsm8k-source.json"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class Gsm8kError(UserError):
    """The raw dataset is missing or not shaped like openai/gsm8k."""


def raw_files(raw_dir: Path, split: str) -> list[Path]:
    files = sorted((raw_dir / "main").glob(f"{split}-*.parquet"))
    if not files:
        if not raw_dir.is_dir():
            where = "the directory does not exist"
        else:
            found = sorted(str(p.relative_to(raw_dir)) for p in raw_dir.rglob("*.parquet"))
            where = f"it holds {', '.join(found)}" if found else "it holds no parquet file"
        raise Gsm8kError(
            f"{raw_dir / 'main' / f'{split}-*.parquet'}: no GSM8K {split} split ({where}). Give the directory of "
            "openai/gsm8k in its Hugging Face layout (main/train-00000-of-00001.parquet, "
            "main/test-00000-of-00001.parquet); on the Ascend runners it is /root/.cache/datasets/openai/gsm8k"
        )
    for path in files:  # each is hashed and read whole: a FIFO or device named like a shard would never end
        if not path.is_file():
            raise Gsm8kError(f"{path}: not a regular file; give the directory of the dataset's parquet files")
    return files


def final_answer(answer: str, where: str) -> str:
    """The number after the last ``####`` of a reference answer, written as verl's scorer writes its own
    extraction (thousands separators removed), so that equal numbers compare equal as strings."""
    _, sep, tail = answer.rpartition("####")
    value = tail.strip().replace(",", "")
    if not sep or not _NUMBER.fullmatch(value):
        shown = tail.strip() if sep else answer[-80:]
        raise Gsm8kError(f"{where}: the answer does not end in '#### <number>' (found {shown!r})")
    return value


def rows(frame: Any, split: str, source: Path, start: int = 0) -> list[dict[str, Any]]:
    """verl RL rows of one raw shard; ``start`` is the shard's first index within its split."""
    missing = [c for c in ("question", "answer") if c not in frame.columns]
    if missing:
        raise Gsm8kError(
            f"{source}: no column {', '.join(map(repr, missing))} (columns: {', '.join(map(str, frame.columns))}); "
            "expected openai/gsm8k's 'main' configuration"
        )
    out = []
    for position, (question, answer) in enumerate(zip(frame["question"], frame["answer"], strict=True)):
        out.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": final_answer(answer, f"{source} row {position}")},
                "extra_info": {"split": split, "index": start + position, "answer": answer, "question": question},
            }
        )
    return out


def convert_split(raw_dir: Path, split: str) -> Any:
    import pandas as pd

    converted = []
    for source in raw_files(raw_dir, split):
        converted += rows(pd.read_parquet(source), split, source, start=len(converted))
    return pd.DataFrame(converted)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def source_stamp(raw_dir: Path) -> dict[str, Any]:
    files = {str(p.relative_to(raw_dir)): _sha256(p) for split in SPLITS for p in raw_files(raw_dir, split)}
    return {"format": FORMAT_VERSION, "files": files}


def _refuse_unwritable(paths: list[Path]) -> None:
    """Before the stamp is read or anything converted: a FIFO there would block the read, and a directory,
    device or FIFO named like an output is never replaced (verl_npu.atomic)."""
    for path in paths:
        why = atomic.output_problem(path)
        if why is not None:
            raise atomic.OutputPathError(f"cannot write {path}: {why}")


def prepare(raw_dir: str | Path, out_dir: str | Path) -> tuple[dict[str, Path], bool]:
    """Write OUT_DIR/{train,test}.parquet from RAW_DIR; returns the files and whether they were (re)written."""
    raw_dir, out_dir = Path(raw_dir), Path(out_dir)
    stamp = source_stamp(raw_dir)
    outputs = {split: out_dir / f"{split}.parquet" for split in SPLITS}
    stamp_path = out_dir / STAMP
    if os.path.lexists(out_dir):
        _refuse_unwritable([*outputs.values(), stamp_path])
    try:
        done = json.loads(stamp_path.read_text()) == stamp and all(p.is_file() for p in outputs.values())
    except (OSError, ValueError):
        done = False
    if done:
        return outputs, False
    out_dir.mkdir(parents=True, exist_ok=True)
    # the outputs are not trustworthy until the new stamp lands (a linked stamp is emptied through its link)
    if stamp_path.is_symlink():
        atomic.write_text(stamp_path, "")
    else:
        stamp_path.unlink(missing_ok=True)
    for split, path in outputs.items():
        frame = convert_split(raw_dir, split)
        # a job killed mid-write must not leave a truncated parquet that the next run would take as done
        atomic.write_with(path, lambda temporary, frame=frame: frame.to_parquet(temporary, index=False))
    atomic.write_text(stamp_path, json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    return outputs, True


def _main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m verl_npu.ci.gsm8k", description=__doc__.split("\n")[0])
    parser.add_argument("raw_dir", help="openai/gsm8k in its Hugging Face layout (main/*.parquet)")
    parser.add_argument("out_dir", help="where train.parquet and test.parquet go")
    args = parser.parse_args(argv)
    try:
        outputs, written = prepare(args.raw_dir, args.out_dir)
    except (UserError, OSError) as exc:  # Gsm8kError, and atomic.OutputPathError for an output path
        print(f"error: {exc}", file=sys.stderr)
        return 2
    verb = "wrote" if written else "up to date:"
    print(f"{verb} {', '.join(map(str, outputs.values()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
