import pytest
from stats import mean, spread


def test_mean():
    assert mean([1.0, 2.0, 3.0]) == 2.0
    assert mean([5.0]) == 5.0


def test_mean_of_nothing():
    with pytest.raises(ValueError):
        mean([])


def test_spread():
    assert spread([3.0, -1.0, 2.0]) == 4.0
