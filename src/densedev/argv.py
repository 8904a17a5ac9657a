"""What the command line says before its flags are parsed: the one rule for which word is the command.

Both the entry point (``densedev.__main__``, which forks ``run``'s first scan before the command module
loads) and the command module (which builds only that command's parser) read it here.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: the entry point loads this first
if TYPE_CHECKING:
    from collections.abc import Sequence


def command_word(argv: Sequence[str]) -> str | None:
    """Return the command ``argv`` names: its first word that is not an option (the top level's own
    options, ``--help`` and ``--version``, take no value), or None."""
    return next((a for a in argv if not a.startswith("-")), None)
