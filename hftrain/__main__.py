import sys

from hftrain.cli import main

sys.exit(main())
