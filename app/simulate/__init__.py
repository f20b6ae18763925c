"""The simulated editor population: users with preferences the model does not know."""
