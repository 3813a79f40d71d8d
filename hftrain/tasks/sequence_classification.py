"""``model.task: sequence_classification``: a ``*ForSequenceClassification`` head on labelled texts (single-label,
multi-label or regression: ``model.problem_type``)."""

from hftrain.tasks.record import Task

TASK = Task(
    name="sequence_classification",
    human="sequence classifier",
    auto_class="AutoModelForSequenceClassification",
    auto_mapping="MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING",
    peft_task_type="SEQ_CLS",
    head_modules=("classifier", "score"),
    labels="config",
    load="hftrain.job:classification_splits",
    prepare="hftrain.job:classification_inputs",
    trainer="hftrain.trainers.classification:SequenceClassificationTrainer",
    pipeline_head="sequence_classification",
)
