"""RestartPolicy: exponential back-off, and giving up past the limit within the window."""
from __future__ import annotations

import pytest

from octavo.engine.restart_policy import RestartPolicy


def test_back_off_doubles_then_gives_up_within_the_window():
    policy = RestartPolicy(max_restarts=3, window_s=60, first_delay_s=0.5, max_delay_s=1.5)
    assert [policy.on_failure(t) for t in (0, 1, 2)] == [0.5, 1.0, 1.5]  # doubled, then capped
    assert policy.on_failure(3) is None  # the fourth death within 60 s


def test_failures_older_than_the_window_are_forgotten():
    policy = RestartPolicy(max_restarts=1, window_s=10, first_delay_s=1.0)
    assert policy.on_failure(0) == 1.0
    assert policy.on_failure(11) == 1.0 and policy.recent_failures == 1
    assert policy.on_failure(12) is None


def test_zero_restarts_gives_up_at_the_first_death():
    assert RestartPolicy(max_restarts=0).on_failure(0) is None


@pytest.mark.parametrize("kw, field", [({"max_restarts": -1}, "engine_max_restarts"), ({"window_s": 0}, "window")])
def test_bad_settings_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        RestartPolicy(**kw)
