import sys

from ctxlaunch.runtime.trainer import stopsignal

stopsignal.install()  # first: a stop signal during the imports below must not kill the rank

from ctxlaunch.runtime import tether  # noqa: E402

tether.hold_to_launcher()  # a rank never outlives the command that started it

from ctxlaunch.runtime.trainer.main import main  # noqa: E402

sys.exit(main())
