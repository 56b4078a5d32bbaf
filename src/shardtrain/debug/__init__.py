"""Convergence debugging: subscribers on module forward/backward, statistics, run comparison."""
