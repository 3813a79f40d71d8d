"""hftrain: distributed fine-tuning over Hugging Face Accelerate and DeepSpeed, done right.

Importing the package is cheap; heavy libraries load in the modules that need them.
"""

__version__ = "0.1.0"
