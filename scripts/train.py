"""Training entry for launchers: ``accelerate launch [--config_file X] scripts/train.py --config job.yaml``.

Equivalent to ``hftrain train``; runs in every launched process.
"""

import sys

from hftrain.cli import entry

if __name__ == "__main__":
    sys.exit(entry(["train", *sys.argv[1:]]))
