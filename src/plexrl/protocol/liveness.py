"""Heartbeat liveness (zguide's Paranoid Pirate): a peer is dead after N silent intervals.

Silence is counted in intervals this side actually lived through, not in wall time, so a
process whose own event loop was blocked (a long import, a slow fixture) does not declare a
healthy peer dead the moment it wakes up.
"""

from __future__ import annotations


class Liveness:
    def __init__(self, liveness: int) -> None:
        if liveness < 1:
            raise ValueError(f"liveness={liveness} must be >= 1")
        self.liveness = liveness
        self._left = liveness
        self._heard = False

    def heard(self) -> None:
        """Anything arrived from the peer."""
        self._heard = True

    def tick(self) -> bool:
        """Call once per heartbeat interval; False once the peer has been silent too long."""
        if self._heard:
            self._left, self._heard = self.liveness, False
        else:
            self._left -= 1
        return self._left > 0

    @property
    def silent_intervals(self) -> int:
        return self.liveness - self._left
