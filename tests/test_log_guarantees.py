"""What the log server itself guarantees: one message per logical-id subject, dead letters once per
refused message, our own retried append told apart from a rival's, and counts on the server's word."""

import pytest

from pipeline.topology import REWARDS, TRAJECTORIES, follower_name

pytestmark = pytest.mark.integration


def test_a_followers_name_carries_the_run_the_reader_and_the_stream():
    assert follower_name("Run-1", "trainer", TRAJECTORIES) == "run-1-trainer-trajectories"
    assert follower_name("run-1", "rewards", REWARDS) == "run-1-rewards-rewards"
    with pytest.raises(ValueError, match="reader"):
        follower_name("run-1", "a.b", TRAJECTORIES)

