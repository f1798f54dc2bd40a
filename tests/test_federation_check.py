"""`flwr run .`: the federation's SuperNodes must be the recipe's population (a local federation's default
SuperNode count once silently trained 2 of 32 clients)."""

from __future__ import annotations

import pytest

from fedfusion.run.federation import check_federation


class Joining:
    """A grid whose nodes connect one per poll, up to ``total``."""

    def __init__(self, total: int, connected: int = 0) -> None:
        self.total, self.seen = total, connected

    def get_node_ids(self) -> list[int]:
        self.seen = min(self.seen + 1, self.total)
        return list(range(self.seen))


def test_nodes_that_connect_within_the_wait_pass():
    assert check_federation(Joining(4), 4, wait_s=5.0, poll_s=0.0) == 4


@pytest.mark.parametrize("total", [2, 5])
def test_fewer_or_more_supernodes_than_clients_is_an_error_naming_both_and_the_fix(total):
    with pytest.raises(ValueError) as err:
        check_federation(Joining(total, connected=total - 1), 4, wait_s=0.05, poll_s=0.01)
    message = str(err.value)
    assert f"has {total} SuperNodes but population.num_clients is 4" in message
    assert 'num-supernodes=4' in message and f"population.num_clients={total}" in message


def test_the_units_mode_expects_its_supernodes_per_client():
    """units.supernodes=2: 4 clients are 8 SuperNodes; 6 connected is an error naming 8 and the client count 3."""
    assert check_federation(Joining(8), 4, per_client=2, wait_s=5.0, poll_s=0.0) == 8
    with pytest.raises(ValueError) as err:
        check_federation(Joining(6, connected=5), 4, per_client=2, wait_s=0.05, poll_s=0.01)
    message = str(err.value)
    assert "2 SuperNodes (units.supernodes)" in message and "num-supernodes=8" in message
    assert "population.num_clients=3" in message
    with pytest.raises(ValueError) as err:  # no client count fits: no override is suggested
        check_federation(Joining(1, connected=0), 4, per_client=2, wait_s=0.05, poll_s=0.01)
    assert "num-supernodes=8" in str(err.value) and "population.num_clients=" not in str(err.value)
