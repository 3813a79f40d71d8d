"""``model.task: causal_lm``: a ``*ForCausalLM`` language model on text packed into blocks (next-token cross
entropy, one mean over the global batch's target tokens)."""

from hftrain.tasks.record import Task

TASK = Task(
    name="causal_lm",
    human="language model",
    auto_class="AutoModelForCausalLM",
    auto_mapping="MODEL_FOR_CAUSAL_LM_MAPPING",
    peft_task_type="CAUSAL_LM",
    head_modules=(),
    labels="none",
    load="hftrain.job:language_splits",
    prepare="hftrain.job:language_inputs",
    trainer="hftrain.trainers.language:CausalLMTrainer",
    pipeline_head="causal_lm",
    per_token_loss=True,
    packed_text=True,
    vocabulary_head=True,
)
