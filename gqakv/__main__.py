"""``python -m gqakv ...`` is the ``gqakv`` command."""

from .cli import main

raise SystemExit(main())
