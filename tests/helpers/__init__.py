"""What several test modules share: device records, simulated nodes, fake pools, spec checks.

Test modules import from here, never from each other (issue 14).  The directory ``tests/`` is on
``sys.path`` because its conftest.py is loaded in pytest's default "prepend" import mode.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

Run = Callable[[Coroutine[Any, Any, Any]], Any]  # conftest's ``run`` fixture, for tests not yet async
