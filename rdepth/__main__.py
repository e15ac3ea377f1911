import sys

from rdepth.cli.main import main

sys.exit(main())
