"""Plain-Python twin of ``densedev._fast``: same functions, same signatures, same results."""

from __future__ import annotations
