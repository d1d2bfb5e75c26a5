"""``python -m unpack_trainer.cli``: the ``unpack-trainer`` command."""

import sys

from unpack_trainer.cli.main import main

sys.exit(main())
