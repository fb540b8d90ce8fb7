import sys

from . import stopsignal

stopsignal.install()  # first: a stop signal during the imports below must not kill the rank

from .main import main  # noqa: E402

sys.exit(main())
