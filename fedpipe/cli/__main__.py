"""``python -m fedpipe.cli``: the ``fedpipe`` command."""

import sys

from fedpipe.cli.main import main

sys.exit(main())
