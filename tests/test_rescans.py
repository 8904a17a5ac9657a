"""Rescan requests: targeted while uevents name devices, full when asked or lost, reconcile on timeout."""

from __future__ import annotations

from densedev.node.rescans import RescanRequests

VF, PF = "0000:3b:00.2", "0000:3b:00.0"


async def test_named_devices_are_one_targeted_rescan() -> None:
    requests = RescanRequests()
    requests.request(VF)
    requests.request(PF)
    await requests.wait(reconcile_s=3600)  # returns: a request is pending
    assert requests.take() == ({VF, PF}, False, False)
    assert requests.take() == (set(), True, False)  # nothing named since: whatever asks next reads all


async def test_a_full_request_swallows_the_targets() -> None:
    requests = RescanRequests()
    requests.request(VF)
    requests.request()
    assert requests.take() == (set(), True, False)


async def test_the_timeout_is_the_periodic_reconcile_once() -> None:
    requests = RescanRequests()
    await requests.wait(reconcile_s=0)
    assert requests.take() == (set(), True, True)
    requests.request(VF)
    await requests.wait(reconcile_s=3600)
    assert requests.take() == ({VF}, False, False)


async def test_lost_uevents_ask_for_a_full_rescan_timed_from_the_first_loss() -> None:
    requests = RescanRequests()
    requests.lost()
    first = requests.lost_at
    requests.lost()  # a second loss before the resync: still timed from the first
    assert first is not None and requests.lost_at == first
    await requests.wait(reconcile_s=3600)  # returns: the loss asked for a rescan
    assert requests.take() == (set(), True, False)
    waited = requests.resynced(first)
    assert waited is not None and waited >= 0 and requests.lost_at is None
    assert requests.resynced(first) is None  # timed once


async def test_a_rescan_begun_before_the_loss_does_not_resync_it() -> None:
    requests = RescanRequests()
    assert requests.resynced(None) is None  # the rescan began with nothing lost
    requests.lost()
    assert requests.resynced(None) is None and requests.lost_at is not None
