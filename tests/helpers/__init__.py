"""What several test modules share; test modules import from here, never from each other (issue 14).

- ``devices``: ``dev``, the one way tests build a Device by hand (``unlinked`` is the selector tests'
  shape on it), ``pool_of``, ``touch`` and sample pool configs.
- ``node``: ``Node``, a simulated node (densedev.testing.simnode) with its config file and daemon
  settings, which the special nodes of test modules extend; ``PREFIX``, ``res``, ``GUARD_S``, ``pool``,
  ``daemon_on``.
- ``pools``: pools chosen from hand-built devices by the real parser and selection.
- ``plugin``: a fake pool service for the device-plugin server, and ``serving`` it.
- ``cdi``: what a runtime's CDI registry checks in a spec.  ``dra``: a DRA NodeService harness.

conftest.py holds the fixtures: ``node``, ``kubelet`` and ``daemon`` (async, set by ``node_options``,
``kubelet_options`` and ``daemon_settings``), ``sock_dir`` and ``pr_dir`` (short dirs for unix sockets),
and runs every async test and fixture on uvloop, failing a test on what its loop reported.  The
directory ``tests/`` is on ``sys.path`` because its conftest.py is loaded in pytest's default "prepend"
import mode.
"""

from __future__ import annotations
