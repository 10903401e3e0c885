"""A stand-in for Hugging Face `datasets`, for the published MegaTrain's data loading only
(benches/compare/run.sh puts it on PYTHONPATH where the real package is not installed: the
real one needs pyarrow, ~40 MB, more than the GPU machine's carry allows).

It covers what `infinity/data/datasets.py` calls on a local JSON file: `load_dataset("json",
data_files=PATH, split="train")` giving an object with `len`, integer indexing to a dict,
`column_names` and `select`. The rows are read before the timed steps begin.
"""

import json

__version__ = "0-shim"


class Dataset:
    def __init__(self, rows):
        self._rows = rows

    def __len__(self):
        return len(self._rows)

    def __getitem__(self, i):
        return self._rows[i]

    @property
    def column_names(self):
        return list(self._rows[0]) if self._rows else []

    def select(self, indices):
        return Dataset([self._rows[i] for i in indices])


def load_dataset(kind, data_files=None, split="train", **kwargs):
    if kind != "json" or not isinstance(data_files, str):
        raise NotImplementedError(
            f"datasets shim (benches/compare): load_dataset({kind!r}, data_files={data_files!r}): "
            "only one local JSON or JSONL file is supported")
    with open(data_files) as f:
        text = f.read()
    if text.lstrip().startswith("["):
        rows = json.loads(text)
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return Dataset(rows)


def load_from_disk(path):
    raise NotImplementedError(
        f"datasets shim (benches/compare): load_from_disk({path!r}) needs the real `datasets`")
