"""A template's pool sized from its episodes' bursts (``burst``), unless a caller sized it
(``isolate.park``): the launcher says when each episode forked from it begins and ends.
Everything here runs in the event loop, and blocks for no longer than a lock.
"""

from __future__ import annotations

import threading

from ..system import admission as _admission
from .pool import MAX_PARKED, PARKED_FDS, Pool
from .process import Template

__all__ = ["began", "ended", "resize"]

#: A pool sized from bursts holds at most 1/_FD_SHARE of the episodes' fd budget.
_FD_SHARE = 4

_making = threading.Lock()


def resize(template: Template, n: int) -> Pool:
    """Keep ``n`` forks of ``template`` parked, their fds counted in the episodes' budget
    (none once the template gave its own back: nothing would give these back); in the event
    loop."""
    with _making:  # one pool per template, however many ask at once
        pool = template.pool
        if pool is None:
            pool = template.pool = Pool(template)
    pool.resize(n)
    pool.release_fds()
    if not template.released:
        pool.hold = _admission.hold_fds(PARKED_FDS * n, f"{template.name}'s parked forks")
    return pool


def began(template: Template) -> None:
    """An episode forked from ``template`` has started; in the event loop. Unless a caller
    sized its pool, the pool grows to the burst going on."""
    template.burst.began()
    _follow(template)


def ended(template: Template) -> None:
    """That episode is over; in the event loop. Once the burst is over, a pool sized by
    bursts keeps what the burst needed."""
    template.burst.ended()
    _follow(template)


def _follow(template: Template) -> None:
    """Size the pool of ``template`` from its bursts, unless a caller sized it. A pool that
    cannot be made (no fd for its thread's pipe) is not: the episodes fork on demand."""
    if template.sized or template.closing or template.released:
        return
    room = _admission.capacity() // (_FD_SHARE * PARKED_FDS)
    n = min(MAX_PARKED, room, template.burst.size())
    pool = template.pool
    if pool is None and n == 0 or pool is not None and pool.target == n:
        return
    try:
        resize(template, n)
    except (OSError, RuntimeError):  # RuntimeError: no thread can be started
        return
