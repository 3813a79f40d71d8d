"""Trainers: the base loop and task-specific subclasses."""

from hftrain.trainers.base import Trainer, TrainerState, TrainResult
from hftrain.trainers.classification import SequenceClassificationTrainer

__all__ = ["SequenceClassificationTrainer", "TrainResult", "Trainer", "TrainerState"]
