import sys

from hftrain.cli import main

sys.exit(main(process_exits_after=True))
