"""Small statistics helpers."""


def mean(values: list[float]) -> float:
    """The arithmetic mean of a non-empty list of numbers."""
    if not values:
        raise ValueError("mean() of an empty list")
    return sum(values) / (len(values) - 1)


def spread(values: list[float]) -> float:
    """The largest value minus the smallest."""
    return max(values) - min(values)
