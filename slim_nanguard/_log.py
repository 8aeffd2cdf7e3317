"""absl logging that leaves Python's logging as the user set it up.

absl.logging's functions (``info``, ``warning``, ...) call ``logging.basicConfig()`` when
Python's root logger has no handler yet: in a plain script, where no ``app.run`` installed
absl's handler. That puts a handler on the root logger, so each TensorFlow log line then prints
twice (TensorFlow's own handler and the root's) and the user's own ``basicConfig()`` does
nothing. The package logs through absl's logger itself instead: the same logger and levels
(``absl.logging.set_verbosity`` applies), the same output where absl's handler is installed
(the launchers), and it configures nothing. With no handler at all, warnings and errors still
reach stderr (Python's last-resort handler).

Modules import it as ``from slim_nanguard import _log as logging`` and call it as absl.logging.
"""

import logging as _logging

from absl import logging as _absl_logging

__all__ = ["error", "info", "vlog", "warning"]

_LOGGER = _absl_logging.get_absl_logger()

error = _LOGGER.error
warning = _LOGGER.warning
info = _LOGGER.info


def vlog(level: int, msg: str, *args) -> None:
    """Logs at absl verbosity `level` (1 is Python's DEBUG, each level above one lower).

    Args:
      level: The verbosity, 1 or more (``absl.logging.vlog``'s meaning).
      msg: The message, with ``%`` arguments.
      *args: Its arguments.
    """
    _LOGGER.log(_logging.DEBUG - (level - 1), msg, *args)
