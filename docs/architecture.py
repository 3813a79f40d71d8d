"""Draw docs/architecture.png, the layers of hftrain from the CLI down to parallel/.

Run from the repository root: ``.venv/bin/python docs/architecture.py``.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

# (x, y, width, height, title, lines, colour); x, y of the lower-left corner, in figure units (0..16, 0..10).
BOXES = [
    (0.3, 8.6, 15.4, 1.1, "cli.py  ·  api.py",
     "hftrain train | export | plan | groups | env | doctor;  hftrain.train(config)"
     "  — the only place that reads argv and the environment", "#dbe9f6"),
    (0.3, 7.2, 7.5, 1.1, "config/  ·  job.py  ·  validate.py",
     "strict config; one validation pass before any write;\nthen write, train, export", "#dbe9f6"),
    (8.2, 7.2, 7.5, 1.1, "plan/  ·  launch/  ·  doctor.py",
     "hftrain plan (formulas, recommendation, --write-configs);\nhostfiles, rendezvous preflight, Slurm", "#eeeeee"),
    (0.3, 5.8, 15.4, 1.1, "trainers/",
     "Trainer: fit → epoch → train_step (forward_backward, clip, optimizer, scheduler) → record, evaluate, "
     "checkpoint;\nSequenceClassificationTrainer: compute_loss / prediction_step / compute_metrics (the task hooks)",
     "#fde9c9"),
    (0.3, 3.6, 7.5, 1.9, "strategies/  (registry: one file + one line per strategy)",
     "Strategy: accelerator, preflight, build_runtime\nddp.py  fsdp.py  deepspeed/ (zero1/2/3)  platform.py\n"
     "runtime.py: AccelerateRuntime — prepare, forward_backward,\nevaluation_step, clip_grad_norm_, reduce_mean, "
     "save/load_state,\nget_state_dict", "#e2f0d9"),
    (8.2, 3.6, 7.5, 1.9, "strategies/megatron/",
     "MegatronStrategy, checks, plugin (the Accelerate adapter)\nruntime.py: TP × CP × DP runtime\n"
     "pipeline_runtime.py: PP runtime (schedules, timeline)\nstate.py: logical checkpoints that reshard", "#e2f0d9"),
    (0.3, 0.8, 15.4, 2.7, "parallel/  (knows neither the Trainer, the config keys nor Accelerate)",
     "axes.py: the axes declared once → dims.py: groups (tp-cp-dp-pp)      parallelize.py: one apply_* call per axis\n"
     "placement.py: one record per parameter (axis, Split, partial) → grads, DDP ignore, clip, boxes, export\n"
     "families/: one module per model family (tp plan, trunk, own heads, refusals) · heads.py: task heads by kind\n"
     "tensor_parallel.py · plans.py · layers.py · collectives.py · expert_parallel.py · cross_entropy.py\n"
     "pipeline.py · stages.py · chunk.py (extras) · schedules.py (task-blind: StageHead) · timeline.py\n"
     "context_parallel.py + cp_attention.py (ring / all-to-all)   random.py (RNG tracker)   recompute.py   "
     "lora.py (LoRA under TP)", "#f4dcdc"),
    (0.3, 0.05, 15.4, 0.65,
     "beside every layer: tasks/ (Task records) · checkpoint/ (session, manager, resume, safety, "
     "export) · models/ (loading, LoRA, partial) · data/ · metrics/", "", "#eeeeee"),
]  # fmt: skip
ARROWS = [
    ((4.0, 8.6), (4.0, 8.3)),
    ((4.0, 7.2), (4.0, 6.9)),
    ((4.0, 5.8), (4.0, 5.5)),
    ((12.0, 5.8), (12.0, 5.5)),
    ((12.0, 3.6), (12.0, 3.3)),
    ((7.8, 4.55), (8.2, 4.55)),
]


def main() -> None:
    fig, ax = plt.subplots(figsize=(16, 10), dpi=100)
    ax.set_xlim(0, 16)
    ax.set_ylim(0, 10)
    ax.axis("off")
    for x, y, w, h, title, text, colour in BOXES:
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=colour, ec="#555555"))
        if text:
            ax.text(x + 0.15, y + h - 0.12, title, va="top", ha="left", fontsize=12, fontweight="bold")
            ax.text(
                x + 0.15, y + h - 0.5, text, va="top", ha="left", fontsize=10.5, family="monospace", linespacing=1.4
            )
        else:
            ax.text(x + 0.15, y + h / 2, title, va="center", ha="left", fontsize=10.5)
    for start, end in ARROWS:
        ax.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": "->", "color": "#333333", "lw": 1.5})
    ax.text(8.0, 9.85, "hftrain: from the command line down to parallel/", ha="center", va="center", fontsize=14)
    out = Path(__file__).with_suffix(".png")
    fig.savefig(out, bbox_inches="tight")
    print(out)


if __name__ == "__main__":
    main()
