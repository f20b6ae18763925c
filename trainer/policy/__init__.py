"""Policies behind one small interface (base.Policy); `build_policy` picks one by name."""
