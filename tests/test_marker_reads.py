"""A resume and an export read each checkpoint's ``checkpoint.json`` once (issue 56: it was read 3-5 times).

One subprocess (audit hooks cannot be removed, so they stay out of pytest's process) trains a tiny classifier 2
steps, saving at step 2; resumes it to step 4; then exports the run folder and the step folder. Every ``open`` of a
``checkpoint.json`` is counted through ``sys.addaudithook`` per command. The resume reads step 2's marker once:
the command's checks open the checkpoint (``hftrain.validate.RunPlan.checkpoint``), the trainer loads what they
opened, and the main process verifies the files' checksums against those bytes. The run-folder export reads each
checkpoint's marker once (the run check reads every one; the latest's bytes are the ones parsed).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import collections, json, sys
from pathlib import Path
root = Path(sys.argv[1])
sys.path.insert(0, sys.argv[2])
from tests.tiny import save_model_folder, write_csv
save_model_folder(root / "model"); write_csv(root / "train.csv"); write_csv(root / "val.csv", 20)
opens = collections.Counter()
phase = ["setup"]
def hook(event, args):
    if event == "open" and str(args[0]).endswith("checkpoint.json"):
        opens[(phase[0], Path(str(args[0])).parent.name)] += 1
sys.addaudithook(hook)
from hftrain.cli import main
def train(steps):
    return main(["train", "--model_name_or_path", str(root / "model"), "--train_file", str(root / "train.csv"),
                 "--validation_file", str(root / "val.csv"), "--output_dir", str(root / "out"), "--max_steps", steps,
                 "--save_steps", "2", "--per_device_train_batch_size", "4", "--resume_from_checkpoint", "auto",
                 "--mixed_precision", "no"])
codes = {}
for phase[0], run in (("first", lambda: train("2")), ("resume", lambda: train("4")),
                      ("export_run", lambda: main(["export", str(root / "out"), str(root / "e1")])),
                      ("export_step", lambda: main(["export", str(root / "out" / "checkpoints" / "step_00000004"),
                                                    str(root / "e2"), "--output_dir", str(root / "out")]))):
    codes[phase[0]] = run()
print("RESULT " + json.dumps({"codes": codes, "opens": {f"{p}/{s}": n for (p, s), n in opens.items()}}))
"""


def test_resume_and_export_read_each_marker_once(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), str(repo)], capture_output=True, text=True, timeout=600
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(line[len("RESULT ") :])
    assert result["codes"] == {"first": 0, "resume": 0, "export_run": 0, "export_step": 0}, result
    assert result["opens"] == {
        "resume/step_00000002": 1,  # the checkpoint resumed: once, checks and load together
        "export_run/step_00000002": 1,  # the run check reads every checkpoint of the run once
        "export_run/step_00000004": 1,  # ... and the latest's bytes are the ones exported
        "export_step/step_00000004": 1,
    }, result
