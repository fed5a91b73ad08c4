"""Datasets: generated verifiable tasks, local jsonl/parquet files, prompt rendering, batches.

``build_dataset(cfg)`` gives records ``{"prompt", "ground_truth", "extra"}``;
``PromptDataLoader`` turns records into left-padded ``DataProto`` prompt batches with a seeded,
resumable order.
"""

from lumenrl_core.data.build import DATASET_NAMES, build_dataloader, build_dataset
from lumenrl_core.data.loader import TRUNCATION_MODES, PromptDataLoader
from lumenrl_core.data.records import get_field, load_records, read_jsonl, read_parquet, rows_to_records
from lumenrl_core.data.tasks import ArithmeticTask, CountdownTask
from lumenrl_core.data.templates import as_messages, has_chat_template, prompt_text, render_prompt

__all__ = [
    "DATASET_NAMES",
    "build_dataloader",
    "build_dataset",
    "TRUNCATION_MODES",
    "PromptDataLoader",
    "get_field",
    "load_records",
    "read_jsonl",
    "read_parquet",
    "rows_to_records",
    "ArithmeticTask",
    "CountdownTask",
    "as_messages",
    "has_chat_template",
    "prompt_text",
    "render_prompt",
]
