"""The check behind the fault tests: a loop that survived a fault returned exactly what the same
loop returned without it (test_worker_recovery.py, test_coordinator_restart.py)."""

from __future__ import annotations

import numpy as np

import plexrl


def assert_same_results(calm: list[object], faulted: list[object]) -> None:
    """Every result equal: sampled tokens, their logprobs and versions, losses, steps, grad norms,
    and the probe's logprobs under the final weights."""
    assert all(r.grad_norm > 0 for r in calm if isinstance(r, plexrl.OptimStepResult))  # the weights moved
    assert len(calm) == len(faulted)
    for a, b in zip(calm, faulted, strict=True):
        assert type(a) is type(b)
        if isinstance(a, plexrl.Generated):
            assert isinstance(b, plexrl.Generated)
            assert [t.tolist() for t in a.tokens] == [t.tolist() for t in b.tokens]
            assert a.weight_version == b.weight_version
            np.testing.assert_array_equal(a.logprobs.values, b.logprobs.values)
        elif isinstance(a, plexrl.LogprobsResult):  # the probe under the final weights
            assert isinstance(b, plexrl.LogprobsResult)
            np.testing.assert_array_equal(a.logprobs.values, b.logprobs.values)
        else:
            assert a == b  # losses, steps, grad norms, versions
