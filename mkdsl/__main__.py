import sys

from mkdsl.cli import main

sys.exit(main())
