import sys

from hftrain.cli import entry

sys.exit(entry())
