import numpy as np
import pytest

from plexrl.errors import BatchShapeError
from plexrl.rollout import group_advantages


def test_advantages_are_normalised_within_each_group() -> None:
    adv = group_advantages([1.0, 0.0, 3.0, 3.0], np.array([0, 0, 1, 1]))
    assert adv == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)


def test_a_reward_per_sample_is_required() -> None:
    with pytest.raises(BatchShapeError, match="one per sample"):
        group_advantages([1.0], np.array([0, 0]))
