"""CPU only: the serving lane lends its core to the rollout lane whenever it has no work.

On a CPU the two lanes are two threads on their own cores (``device.py``). While the serving
lane has nothing to compute its core would sit idle, so the rollout lane widens over it
(more torch threads): the CPU analogue of best-effort kernels filling idle SMs. Before the
serving lane computes again it takes the core back: an arrival recalls it at once, the
rollout lane narrows at its forward's next layer safepoint (about a layer's time, a
millisecond or two here) and the serving lane waits for that, bounded by
``RETURN_TIMEOUT_S``. The rollout forward is never abandoned for this: narrowing only
changes how many threads its next ops use. The GPU needs none of this: streams share the
SMs by themselves.

Why a lock: "lent" (set by the serving side) and "wide" (set by the rollout lane) must
change together, or the serving lane could take its core back just as the rollout lane
widens over it and then compete with it for a whole layer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

RETURN_TIMEOUT_S = 0.02  # the serving lane waits at most this long for its core (a stuck rollout op never stalls serving longer)


class CoreLending:
    """The rollout lane's thread width, and the serving lane's loan of its core."""

    def __init__(self, narrow: int, wide: int, set_width: Callable[[int], None], return_timeout_s: float = RETURN_TIMEOUT_S) -> None:
        self.narrow, self.wide = narrow, wide
        self.return_timeout_s = return_timeout_s
        self.enabled = wide > narrow
        self._set_width = set_width
        self._lock = threading.Lock()
        self._lent = False  # the serving lane has no work: its core may be used
        self._is_wide = False  # the rollout lane's threads currently span the serving lane's core
        self._returned = threading.Event()
        self._returned.set()
        self.returns = 0  # times the serving lane had to wait for its core

    @property
    def is_wide(self) -> bool:
        return self._is_wide

    @property
    def lent(self) -> bool:
        return self._lent

    # ---- serving side (the serving lane, or submit on the event loop)
    def lend(self) -> None:
        if self.enabled:
            self._lent = True

    def recall(self) -> None:
        """The serving lane needs its core soon (an arrival): the rollout lane narrows at its next safepoint."""
        self._lent = False

    def take_back(self) -> None:
        """Recall the core and wait until the rollout lane has narrowed (at most ``return_timeout_s``)."""
        if not self.enabled:
            return
        with self._lock:
            self._lent = False
            wide = self._is_wide
            if wide:
                self._returned.clear()
        if wide:
            self.returns += 1
            self._returned.wait(self.return_timeout_s)

    # ---- rollout side (the rollout lane's thread only: torch thread counts are per thread)
    def fit(self, may_widen: bool = True) -> bool:
        """Widen over a lent core or narrow off a recalled one; returns True when it just narrowed.
        ``may_widen=False``: the lane stops computing (idle, paused, no lease), so it narrows now:
        no safepoint would come to narrow it when the serving lane takes its core back."""
        if not self.enabled:
            return False
        with self._lock:
            want = self._lent and may_widen
            if want == self._is_wide:
                return False
            self._is_wide = want
        self._set_width(self.wide if want else self.narrow)
        if not want:
            self._returned.set()
        return not want
