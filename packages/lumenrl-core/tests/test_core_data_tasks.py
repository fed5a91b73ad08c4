"""Generated tasks, file sources, prompt rendering and the resumable PromptDataLoader."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from lumenrl_core.config.schema import DatasetConfig
from lumenrl_core.data import (
    ArithmeticTask,
    CountdownTask,
    PromptDataLoader,
    build_dataloader,
    build_dataset,
    load_records,
    render_prompt,
)
from lumenrl_core.data_proto import DataProto
from lumenrl_core.rewards import CountdownReward, MathReward, evaluate_expression

DEMO_CHARS = set("0123456789+-*/=() abcdefghijklmnopqrstuvwxyz.,:;?!'#\n")


class CharTokenizer:
    """The HF tokenizer interface, character level: pad 0, bos 1, eos 2, chars from 3."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __init__(self, chat: bool = False) -> None:
        self.chat_template = "role: content" if chat else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([self.bos_token_id] if add_special_tokens else []) + [3 + ord(c) % 200 for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        assert tokenize is False
        body = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return body + ("<assistant>" if add_generation_prompt else "")


def test_arithmetic_task_is_seeded_correct_and_tiny_model_friendly():
    task = ArithmeticTask(num_examples=300, difficulty=2, ops=("+", "-", "*"), seed=7)
    records = task.records()
    assert records == ArithmeticTask(num_examples=300, difficulty=2, ops=("+", "-", "*"), seed=7).records()
    assert records != ArithmeticTask(num_examples=300, difficulty=2, ops=("+", "-", "*"), seed=8).records()
    ops = set()
    for rec in records:
        a, op, b = rec["extra"]["a"], rec["extra"]["op"], rec["extra"]["b"]
        ops.add(op)
        assert rec["prompt"] == f"{a}{op}{b}=" == ArithmeticTask.format_prompt(a, op, b)
        assert int(rec["ground_truth"]) == {"+": a + b, "-": a - b, "*": a * b}[op] >= 0
        assert 0 <= a <= 99 and 0 <= b <= 99
        assert set(rec["prompt"]) <= DEMO_CHARS and len(rec["ground_truth"]) <= 8
    assert ops == {"+", "-", "*"}
    # the bare answer (then EOS) is what the tiny model emits: the math reward must accept it
    rewards = MathReward()(
        [r["prompt"] for r in records], [r["ground_truth"] for r in records], [dict(r) for r in records]
    )
    assert rewards == [1.0] * len(records)
    with pytest.raises(ValueError, match="difficulty=0"):
        ArithmeticTask(difficulty=0)
    with pytest.raises(ValueError, match="ops=\\('/',\\)"):
        ArithmeticTask(ops=("/",))


def test_countdown_task_problems_are_solvable():
    task = CountdownTask(num_examples=200, num_numbers=3, seed=2)
    records = task.records()
    reward = CountdownReward()
    for rec in records:
        value, used = evaluate_expression(rec["extra"]["solution"])
        assert value == rec["ground_truth"]["target"] and sorted(used) == sorted(
            rec["ground_truth"]["numbers"]
        )
        assert set(rec["prompt"]) <= DEMO_CHARS
    solutions = [r["extra"]["solution"] for r in records]
    assert reward([r["prompt"] for r in records], solutions, [r["extra"] for r in records]) == [1.0] * 200
    instruct = CountdownTask(num_examples=1, instruct=True).records()[0]["prompt"]
    assert "<answer>" in instruct


def test_test_split_excludes_train_prompts():
    cfg = DatasetConfig(name="arithmetic", difficulty=2, num_examples=500)
    train = build_dataset(cfg, seed=1)
    test = build_dataset(cfg, seed=1, split="test", num_examples=100)
    assert len(test) == 100
    assert not {r["prompt"] for r in test} & {r["prompt"] for r in train}
    with pytest.raises(ValueError, match="did you mean 'arithmetic'"):
        build_dataset(DatasetConfig(name="arithmetik"))
    with pytest.raises(ValueError, match="needs dataset.path"):
        build_dataset(DatasetConfig(name="jsonl"))


def test_jsonl_records_with_dotted_keys(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [
        {"question": "1+1=", "reward_model": {"ground_truth": "2"}, "level": 1},
        {"question": "2+3=", "reward_model": {"ground_truth": "5"}, "level": 2},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    records = load_records(path, prompt_key="question", answer_key="reward_model.ground_truth")
    assert [r["prompt"] for r in records] == ["1+1=", "2+3="]
    assert [r["ground_truth"] for r in records] == ["2", "5"]
    assert records[1]["extra"]["level"] == 2
    with pytest.raises(KeyError, match="row 0: key 'answer' not found"):
        load_records(path, prompt_key="question", answer_key="answer")
    path.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(ValueError, match="data.jsonl:2: invalid JSON"):
        load_records(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_records(tmp_path / "missing.jsonl")


def test_parquet_records(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "data.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "4+4=", "answer": "8"}, {"prompt": "9-1=", "answer": "8"}]), path
    )
    cfg = DatasetConfig(name="parquet", path=str(path))
    assert [r["ground_truth"] for r in build_dataset(cfg)] == ["8", "8"]


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "data.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"lumenrl-core\[parquet\]"):
        load_records(path)


def test_render_prompt_chat_template_or_format_string():
    text, templated = render_prompt(CharTokenizer(chat=True), "1+2=")
    assert (text, templated) == ("<user>1+2=\n<assistant>", True)
    text, templated = render_prompt(
        CharTokenizer(chat=True), "1+2=", use_chat_template=False, prompt_template="q {prompt}"
    )
    assert (text, templated) == ("q 1+2=", False)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="}]
    assert render_prompt(CharTokenizer(), messages, prompt_template="Q: {prompt} A:")[0] == "Q: 1+2= A:"
    with pytest.raises(ValueError, match="prompt_template='{question}'"):
        render_prompt(CharTokenizer(), "x", prompt_template="{question}")


def _records(n: int) -> list[dict]:
    return ArithmeticTask(num_examples=n, difficulty=2, seed=0).records()


def test_loader_batches_are_left_padded_data_protos():
    tok = CharTokenizer(chat=True)
    loader = PromptDataLoader(_records(20), tok, batch_size=4, max_prompt_length=64, seed=3)
    batch = loader.next_batch()
    assert isinstance(batch, DataProto) and len(batch) == 4
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    assert ids.dtype == mask.dtype == torch.long and ids.shape == mask.shape
    for r in range(4):
        record = loader.records[int(batch.non_tensor_batch["index"][r])]
        expected = tok.encode(render_prompt(tok, record["prompt"])[0], add_special_tokens=False)
        n = int(mask[r].sum())
        assert ids[r, -n:].tolist() == expected and n == len(expected)
        assert torch.all(mask[r, : ids.shape[1] - n] == 0) and torch.all(ids[r, : ids.shape[1] - n] == 0)
        assert batch.non_tensor_batch["raw_prompt"][r] == record["prompt"]
        assert batch.non_tensor_batch["extra"][r]["ground_truth"] == record["ground_truth"]
    assert batch.meta_info == {"epoch": 0, "position": 0}


def test_loader_epochs_cover_data_and_reshuffle():
    loader = PromptDataLoader(_records(10), CharTokenizer(), batch_size=3, max_prompt_length=64, seed=5)
    assert len(loader) == 3  # drop_last
    epoch0 = [int(i) for b in loader for i in b.non_tensor_batch["index"]]
    epoch1 = [int(i) for b in loader for i in b.non_tensor_batch["index"]]
    assert len(set(epoch0)) == 9 and len(epoch1) == 9 and epoch0 != epoch1
    assert loader.epoch == 2 and loader.position == 0
    fixed = PromptDataLoader(
        _records(10), CharTokenizer(), batch_size=4, max_prompt_length=64, shuffle=False, drop_last=False
    )
    assert [len(b) for b in fixed] == [4, 4, 2]


def test_loader_resume_reproduces_the_stream():
    def stream(loader, n):
        return [b.non_tensor_batch["index"].tolist() for b in (loader.next_batch() for _ in range(n))]

    def make():
        return PromptDataLoader(_records(23), CharTokenizer(), batch_size=4, max_prompt_length=64, seed=11)

    full = stream(make(), 12)  # crosses two epoch boundaries (5 batches per epoch)
    first = make()
    head = stream(first, 7)
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = make()
    resumed.load_state_dict(state)
    assert head + stream(resumed, 5) == full
    other = PromptDataLoader(_records(23), CharTokenizer(), batch_size=4, max_prompt_length=64, seed=12)
    with pytest.raises(ValueError, match="does not match"):
        other.load_state_dict(state)


def test_loader_max_prompt_length_filter_left_error():
    records = [{"prompt": "1" * n, "ground_truth": "1", "extra": {}} for n in (3, 9, 4, 12, 5)]
    tok = CharTokenizer()  # plain: bos + chars
    filtered = PromptDataLoader(records, tok, batch_size=2, max_prompt_length=6, truncation="filter")
    assert filtered.num_filtered == 2 and len(filtered.records) == 3
    left = PromptDataLoader(records, tok, batch_size=5, max_prompt_length=6, truncation="left", shuffle=False)
    batch = left.next_batch()
    assert batch.batch["input_ids"].shape == (5, 6) and left.num_filtered == 0
    assert batch.batch["input_ids"][1].tolist() == tok.encode("1" * 9)[-6:]
    with pytest.raises(ValueError, match="max_prompt_length=6"):
        PromptDataLoader(records, tok, batch_size=2, max_prompt_length=6, truncation="error")
    with pytest.raises(ValueError, match="fewer than batch_size=4"):
        PromptDataLoader(records, tok, batch_size=4, max_prompt_length=6)
    with pytest.raises(ValueError, match="truncation='right'"):
        PromptDataLoader(records, tok, batch_size=1, max_prompt_length=6, truncation="right")


def test_build_dataloader_from_config():
    cfg = DatasetConfig(name="countdown", num_examples=40, train_batch_size=8, difficulty=2)
    loader = build_dataloader(cfg, CharTokenizer(chat=True), max_prompt_length=64, seed=1)
    batch = loader.next_batch()
    assert batch.batch["input_ids"].shape[0] == 8
    assert set(batch.non_tensor_batch["extra"][0]) >= {"numbers", "target", "ground_truth"}
    test = build_dataloader(cfg, CharTokenizer(), max_prompt_length=64, seed=1, split="test", num_examples=10)
    assert sum(len(b) for b in test) == 10


def test_rows_with_their_own_max_new_tokens_become_a_batch_column(tmp_path):
    path = tmp_path / "caps.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1), "max_new_tokens": 3 + i}) + "\n"
                            for i in range(6)))
    loader = PromptDataLoader(load_records(path), CharTokenizer(), batch_size=3, max_prompt_length=16, shuffle=False)
    batch = loader.next_batch()
    assert batch.non_tensor_batch["max_new_tokens"].tolist() == [3, 4, 5]
    plain = PromptDataLoader(ArithmeticTask(num_examples=8, seed=0).records(), CharTokenizer(), batch_size=2,
                             max_prompt_length=16)
    assert "max_new_tokens" not in plain.next_batch().non_tensor_batch  # no field, no column


@pytest.mark.parametrize("rows,bad", [
    ([{"max_new_tokens": 4}, {}], "row 1: max_new_tokens=None"),  # in some rows only
    ([{"max_new_tokens": 4}, {"max_new_tokens": 0}], "row 1: max_new_tokens=0"),
    ([{"max_new_tokens": "8"}, {"max_new_tokens": 4}], "row 0: max_new_tokens='8'"),
])
def test_max_new_tokens_field_is_checked(tmp_path, rows, bad):
    path = tmp_path / "caps.jsonl"
    path.write_text("".join(json.dumps({"prompt": "1+1=", "answer": "2", **row}) + "\n" for row in rows))
    with pytest.raises(ValueError, match=bad.replace("+", r"\+")):
        PromptDataLoader(load_records(path), CharTokenizer(), batch_size=1, max_prompt_length=16)
