"""``model.task: token_classification``: a ``*ForTokenClassification`` head labelling each word (named entities,
parts of speech) from JSON Lines of ``tokens``/``tags`` (``hftrain.data.word_labels``); the loss is the mean over
the global batch's labelled words (``hftrain.trainers.token_classification``)."""

from hftrain.tasks.record import Task

TASK = Task(
    name="token_classification",
    human="token classifier",
    auto_class="AutoModelForTokenClassification",
    auto_mapping="MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING",
    peft_task_type="TOKEN_CLS",
    head_modules=("classifier", "score"),
    labels="data",
    load="hftrain.data.word_labels:load_word_label_splits",
    prepare="hftrain.data.word_labels:prepare_word_label_inputs",
    trainer="hftrain.trainers.token_classification:TokenClassificationTrainer",
    pipeline_head="token_classification",
    per_token_loss=True,
    # tp (+sp), pp and cp train as one process (tests/test_token_classification.py; a mixture of experts at cp:
    # tests/test_cp_families_resume.py); expert parallelism is untried
    megatron_axes_not_built=("ep",),
)
