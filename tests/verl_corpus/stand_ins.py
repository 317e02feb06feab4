"""Stand-ins for the Python files verl's launch scripts name (``$USER_CODE`` in the corpus): the
functions and classes under the names the scripts give, with verl's signatures, so that the rest
of each script is what ``skip run --check`` validates. They read the corpus's own rows."""

import pyarrow.parquet as pq
import torch


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's reward signature; a dict with GDPO's parts (rlla.py's keys) beside the score."""
    correct = float(solution_str.strip().endswith(str(ground_truth)))
    return {"score": correct, "accuracy_reward": correct, "format_reward": float("Answer:" in solution_str)}


class CustomRLHFDataset(torch.utils.data.Dataset):
    """ReTool's class name, built as verl builds a data.custom_cls: the verl rows of its files."""

    def __init__(self, data_files, tokenizer, config, processor=None, max_samples=-1):
        self.rows = [row for path in data_files for row in pq.read_table(path).to_pylist()]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]
