from plexrl.protocol.liveness import Liveness


def test_a_peer_is_dead_after_liveness_silent_intervals() -> None:
    live = Liveness(3)
    assert [live.tick(), live.tick(), live.tick()] == [True, True, False]


def test_hearing_from_the_peer_resets_the_count() -> None:
    live = Liveness(2)
    assert live.tick()
    live.heard()
    assert live.tick() and live.silent_intervals == 0
    assert live.tick() and not live.tick()
