"""Benchmarks (never tests): each prints GPU, commit, date, command, the number and its ratio to the limit."""
