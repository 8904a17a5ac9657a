"""Config reloads: the file watched, loaded off the loop, refused with one line per problem, never fatal.

SIGHUP and a change seen on disk only ask for a reload; one loop performs them one at a time and hands
each new, valid config to ``apply`` (the daemon's hook into ``Rediscovery.reconfigure``: one pool-set
diff, as rescans take), then counts and logs what changed.  Whatever a reload raises is logged and
counted, and the last good config stays.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from . import files, workers
from .model import Config
from .ops.logs import log_event
from .ops.metrics import Metrics
from .pools import config as config_mod
from .poolset import PoolChanges
from .workers import Work

log = logging.getLogger("densedev.reload")
applied_log = logging.getLogger("densedev.daemon")  # "config reloaded" kept the daemon's logger when it moved


class ConfigReloader:
    """Reloads one config file on request and hands a changed, valid config to ``apply``."""

    def __init__(
        self,
        path: Path | None,
        *,
        default_prefix: str,
        poll_s: float,
        metrics: Metrics,
        current: Callable[[], Config],
        apply: Callable[[Config], Awaitable[PoolChanges]],
        served: Callable[[], int],
    ) -> None:
        self.path = path  # None: no file, nothing to reload
        self.default_prefix = default_prefix
        self.poll_s = poll_s
        self.metrics = metrics
        self._current = current
        self._apply = apply  # on failure it raises, the config it found still the current one
        self._served = served  # how many device-plugin pools are served (for the log line)
        self._requested = asyncio.Event()

    def request(self) -> None:
        """Reload the config file soon (SIGHUP or a change seen on disk)."""
        self._requested.set()

    async def watch(self) -> None:
        """Ask for a reload whenever the file the path resolves to changes (runs until cancelled)."""
        # A ConfigMap mount updates by swapping the `..data` symlink, so watch the resolved target and its
        # identity, not just the path's mtime.
        path = self.path
        assert path is not None
        last = files.resolved_identity(path)
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                now = files.resolved_identity(path)
            except Exception:
                log.exception("config watch: cannot stat %s; trying again", path)
                continue
            if now != last:
                last = now
                self.request()

    async def run(self) -> None:
        """Perform the requested reloads one at a time (runs until cancelled)."""
        # This task is the only way SIGHUP and file changes take effect: if it died, every later reload
        # would be ignored without a word.  Whatever a reload raises is logged and counted, and the
        # last good config stays.
        while True:
            await self._requested.wait()
            self._requested.clear()
            try:
                await self.reload()
            except Exception:
                self.metrics.record_reload(False)
                log.exception("config reload failed; the last good config stays")

    async def reload(self) -> bool:
        """Load the config file again and apply it: new pools start, removed stop, changed update in place.

        Returns False, logging why, when the file is refused or applying it fails; the daemon then keeps
        running on the last good config.
        """
        path = self.path
        if path is None:
            return False
        try:
            # In a worker thread: a 1 MiB file full of problems takes a while to validate, and the loop
            # keeps health and the kubelet's calls going meanwhile.
            new = await workers.run(Work.CONFIG, config_mod.load, path, default_prefix=self.default_prefix)
        except config_mod.ConfigError as exc:
            self.metrics.record_reload(False)
            for p in exc.problems:
                log_event(log, "config reload refused", level=logging.ERROR, file=str(path), problem=p)
            return False
        except Exception as exc:
            # load() turns every problem of the file into ConfigError; anything else is a bug, and still
            # must not end the daemon's reloads.
            self.metrics.record_reload(False)
            log_event(
                log, "config reload refused", level=logging.ERROR, file=str(path), problem=repr(exc)[:500]
            )
            return False
        for warning in new.warnings:
            log_event(log, "config warning", level=logging.WARNING, file=str(path), problem=warning)
        if new == self._current():
            return True
        try:
            changes = await self._apply(new)
        except Exception:
            self.metrics.record_reload(False)
            log.exception("applying the reloaded config failed; the last good config stays")
            return False
        self.metrics.record_reload(True)
        log_event(
            applied_log,
            "config reloaded",
            added=",".join(changes.added) or "-",
            removed=",".join(changes.removed) or "-",
            changed=",".join(changes.changed) or "-",
            reregistered=",".join(changes.reregister) or "-",
            pools=self._served(),
        )
        return True
